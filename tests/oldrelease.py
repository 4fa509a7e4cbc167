"""The previous release of kxlb, runnable beside this checkout: its tree from git (the
commit RELEASES names), laid out as the `kxlb` package it installs as, with this
checkout's compiled Maglev extension (loader/_maglev.c is the same in both)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import io
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RELEASES = {"0.1.0": "db118466673525bd41aa1ff52b33df9ccd810841",
            "0.2.0": "e7d273d4f5128765acdce3bffcf2b7c56c350ce5"}
PREVIOUS = "0.2.0"
"""The release this one upgrades from (docs/operations.md, Upgrades); every release in
RELEASES is upgraded from and rolled back to by tests/test_upgrade.py."""

RUN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from kxlb.cli import main; sys.exit(main(sys.argv[1:]))"
RUN_SOCKLB = ("import sys; sys.path.insert(0, sys.argv[1]); from kxlb.loader.socklb import attach_socket_lb; "
              "attach_socket_lb(sys.argv[2], sys.argv[3])")
"""That release's socket hooks on a cgroup (argv: path, pin dir, cgroup), as its controller attaches them."""


def build(dest: Path, release: str = PREVIOUS) -> Path:
    """Unpack ``release`` under ``dest``; returns the directory to put first on sys.path."""
    commit = RELEASES[release]
    r = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"kxlb {release} ({commit}) is not in this clone's history: {r.stderr.decode().strip()} "
                           f"(the upgrade tests need a clone with history, not a shallow one)")
    tree = dest / f"kxlb-{release}"
    tarfile.open(fileobj=io.BytesIO(r.stdout)).extractall(tree)
    so = next((REPO / "loader").glob("_maglev*.so"))
    if (tree / "loader" / "_maglev.c").read_bytes() != (REPO / "loader" / "_maglev.c").read_bytes():
        raise RuntimeError(f"loader/_maglev.c differs from {release}'s: build its extension instead of copying ours")
    shutil.copy(so, tree / "loader" / so.name)
    pkg = dest / f"pkg-{release}" / "kxlb"
    pkg.mkdir(parents=True)
    for f in (tree / "kxlb").glob("*.py"):
        shutil.copy(f, pkg / f.name)
    for sub in ("loader", "controller", "lab", "bpf"):
        os.symlink(tree / sub, pkg / sub)
    return pkg.parent


def command(path: Path, *args: str) -> list[str]:
    """argv running that release's `kxlb ARGS...`."""
    return [sys.executable, "-c", RUN, str(path), *args]
