"""The Vagrant lab VM cannot boot here (no hypervisor): check what can be checked."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

VAGRANTFILE = Path(__file__).resolve().parent.parent / "vagrant" / "Vagrantfile"


def test_vagrantfile_is_valid_ruby():
    r = subprocess.run(["ruby", "-c", str(VAGRANTFILE)], capture_output=True, text=True)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stderr


def test_vagrantfile_provisions_with_the_projects_own_setup():
    text = VAGRANTFILE.read_text()
    assert "make -C /kxlb setup" in text
    assert re.search(r'synced_folder "\.\.", "/kxlb"', text)
    assert "public_network" not in text and "bridge:" not in text  # never bridged to the uplink
