"""The Vagrant lab VM's files kept consistent with each other (the VM itself runs in
`make vagrant-test`, which CI runs after the suite), and the set-up's Go toolchain step."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kxlb.lab import vagrant as lab_vagrant

ROOT = Path(__file__).resolve().parent.parent
VAGRANTFILE = ROOT / "vagrant" / "Vagrantfile"


def _load_go_toolchain():
    spec = importlib.util.spec_from_file_location("go_toolchain", ROOT / "scripts" / "go_toolchain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


go_toolchain = _load_go_toolchain()


def test_vagrantfile_is_valid_ruby():
    r = subprocess.run(["ruby", "-c", str(VAGRANTFILE)], capture_output=True, text=True)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stderr


def test_vagrantfile_names_what_the_box_recipe_and_the_host_network_make():
    text = VAGRANTFILE.read_text()
    assert f'config.vm.box = "{lab_vagrant.BOX_NAME}"' in text
    assert f'libvirt__network_name: "{lab_vagrant.NETWORK}"' in text
    # The VM's address comes from the guest agent (no management network): the box has it.
    assert "lv.mgmt_attach = false" in text and "lv.qemu_use_agent = true" in text
    assert "qemu-guest-agent" in lab_vagrant.BOX_PACKAGES
    # The project is synced with rsync, where the tests run from; the box has rsync and sudo.
    assert re.search(rf'synced_folder "\.\.", "{lab_vagrant.VM_PROJECT}", type: "rsync"', text)
    assert {"rsync", "sudo"} <= set(lab_vagrant.BOX_PACKAGES)
    assert 'synced_folder ".", "/vagrant", disabled: true' in text
    assert f"make -C {lab_vagrant.VM_PROJECT} setup" in text
    assert f'config.vm.define "{lab_vagrant.VM_NAME}"' in text and 'lv.default_prefix = ""' in text


def test_the_vms_tests_are_tests_of_the_suite():
    """Every node id the VM runs names a test the suite collects (a rename would make the VM
    run nothing of it, and pytest would stop with "not found")."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *lab_vagrant.VM_TESTS], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    collected = [l for l in r.stdout.splitlines() if "::" in l]
    assert sum(1 for t in lab_vagrant.VM_TESTS if "::" in t) <= len(collected)
    assert any(l.startswith("tests/test_prog_run.py::") for l in collected)
    for left_out in lab_vagrant.VM_DESELECT:    # each names tests the VM would otherwise run
        assert any(l.startswith(left_out) for l in collected), left_out


def test_the_vm_is_never_bridged_or_natted_on_the_host():
    text = VAGRANTFILE.read_text()
    assert "public_network" not in text and "bridge:" not in text
    assert "libvirt__forward_mode" not in text   # the network is lab/vagrant.py's, in bridge mode
    # The network lab/vagrant.py gives libvirt: bridge mode (no rules), addresses only.
    src = Path(lab_vagrant.__file__).read_text()
    assert "<forward mode='bridge'/>" in src and "--dhcp-option=3" in src and "--port=0" in src


def test_the_box_runs_the_setups_own_package_step():
    customize = (ROOT / "vagrant" / "box-customize.sh").read_text()
    assert "KXLB_SETUP_ONLY=packages bash /tmp/kxlb-setup/scripts/setup.sh" in customize
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    gate = setup.index('KXLB_SETUP_ONLY:-}" != packages')
    assert setup.index("apt-get install") < gate < setup.index("Kernel headers for BCC")


def test_the_box_key_follows_its_inputs(tmp_path, monkeypatch):
    build = lab_vagrant.BoxBuild(out=tmp_path, log=lambda m: None)
    monkeypatch.setenv("KXLB_DEBIAN_DATE", "2026-11")
    k = build.key()
    assert build.key() == k
    monkeypatch.setenv("KXLB_DEBIAN_DATE", "2026-12")   # a month later: security updates
    assert build.key() != k
    monkeypatch.setattr(lab_vagrant, "BOX_PACKAGES", lab_vagrant.BOX_PACKAGES + ("vim",))
    monkeypatch.setenv("KXLB_DEBIAN_DATE", "2026-11")
    assert build.key() != k


def test_results_from_junit_count_every_suite_and_a_skip_is_not_ok():
    xml = ('<?xml version="1.0"?><testsuites>'
           '<testsuite name="a" tests="5" failures="0" errors="0" skipped="0"/>'
           '<testsuite name="b" tests="3" failures="1" errors="0" skipped="1">'
           '<testcase classname="tests.test_netns" name="test_x[tc]"><failure message="assert 1 == 2&#10;more">'
           'tb</failure></testcase><testcase classname="tests.test_netns" name="test_y"/>'
           '<testcase classname="tests.test_netns" name="test_z"><skipped message="no root"/></testcase>'
           '</testsuite></testsuites>')
    r = lab_vagrant.Results.from_junit(xml)
    assert (r.tests, r.failures, r.errors, r.skipped) == (8, 1, 0, 1) and not r.ok()
    assert r.not_passed == ("tests.test_netns::test_x[tc] (failure): assert 1 == 2",
                            "tests.test_netns::test_z (skipped): no root")
    assert r.summary() == "8 tests, 1 failed, 0 errors, 1 skipped"
    assert lab_vagrant.Results.from_junit('<testsuite tests="4" failures="0" errors="0" skipped="0"/>').ok()
    assert not lab_vagrant.Results.from_junit('<testsuite tests="0"/>').ok()


def test_host_state_differences_name_what_changed():
    a = lab_vagrant.HostState("0", "0", "table inet x {}\n", "# Generated at 1\n*filter\n")
    same = lab_vagrant.HostState("0", "0", "table inet x {}\n", "# Generated at 2\n*filter\n")
    assert a.differences(same) == []
    b = lab_vagrant.HostState("1", "0", "table inet x {}\ntable ip nat {}\n", "*filter\n")
    assert a.differences(b) == ["net.ipv4.ip_forward", "the nftables ruleset"]


# -- the Go toolchain step of the set-up -------------------------------------------------------

def test_go_dirhash_matches_the_go_commands_own_hashes():
    """Our h1 of module zips against the .ziphash files the go command wrote in its cache."""
    cache = Path(subprocess.run([go_toolchain.find_go(check_only=True), "env", "GOMODCACHE"], capture_output=True, text=True,
                                check=True).stdout.strip()) / "cache" / "download"
    checked = 0
    for ziphash in sorted(cache.glob("golang.org/x/*/@v/*.ziphash"))[:3]:
        with zipfile.ZipFile(ziphash.with_suffix(".zip")) as z:
            assert go_toolchain.dirhash_h1(z) == ziphash.read_text().strip(), ziphash
        checked += 1
    assert checked, f"no module zips in {cache} (the set-up's lab build fills it)"


def test_a_toolchain_zip_that_does_not_match_the_pin_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "v0.0.1-go1.26.8.linux-amd64.zip"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("golang.org/toolchain@v0.0.1-go1.26.8.linux-amd64/bin/go", b"#!/bin/sh\necho evil\n")
    (tmp_path / "golang.org" / "toolchain" / "@v").mkdir(parents=True)
    bad.rename(tmp_path / "golang.org" / "toolchain" / "@v" / bad.name)
    monkeypatch.setenv("GOPROXY", f"file://{tmp_path}")
    version, h1 = go_toolchain.pinned("amd64")
    with pytest.raises(go_toolchain.ToolchainError, match="is not the pinned"):
        go_toolchain.fetch(version, h1, tmp_path / "out" / "go")
    assert not (tmp_path / "out" / "go").exists()


def test_an_old_go_is_passed_over_for_the_pinned_toolchain(tmp_path, monkeypatch):
    old = tmp_path / "go"
    old.write_text("#!/bin/sh\necho go1.19.8\n")
    old.chmod(0o755)
    monkeypatch.setenv("KXLB_GO", str(old))
    monkeypatch.setenv("PATH", str(tmp_path))           # no other go than the old one
    monkeypatch.setattr(go_toolchain, "go_version",
                        lambda go: "go1.19.8" if go in (str(old), "/usr/local/go/bin/go") else None)
    monkeypatch.setenv("KXLB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(go_toolchain.ToolchainError, match=r"no Go >= 1\.26"):
        go_toolchain.find_go(check_only=True)
    version, _ = go_toolchain.pinned("amd64")
    pinned_go = tmp_path / "cache" / "go" / version.split("-", 1)[1] / "bin" / "go"
    pinned_go.parent.mkdir(parents=True)
    pinned_go.write_text("")
    assert go_toolchain.find_go(check_only=True) == str(pinned_go)


def test_the_pinned_toolchain_builds_the_labs_modules():
    need = go_toolchain.version_tuple(go_toolchain.required())
    for arch in ("amd64", "arm64"):
        version, h1 = go_toolchain.pinned(arch)
        assert go_toolchain.version_tuple(version.split("-", 1)[1]) >= need
        assert re.fullmatch(r"h1:[A-Za-z0-9+/]{43}=", h1)
