"""loader/mounts.py on this machine's real mounts: the file system under a path (mountinfo,
escapes included), the bpffs the DaemonSet's init container mounts when a node has none
(`kxlb mount-bpffs`), and the cgroup v2 directory `--cgroup /sys/fs/cgroup` means on a
cgroup v1 hybrid host (this one) or a v2 host."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from kxlb.loader.errors import KxlbError
from kxlb.loader.mounts import cgroup2_dir, fstype, mount_bpffs


@pytest.fixture
def mountpoint():
    """An empty directory whose name has a space (mountinfo writes it as \\040), unmounted
    and removed afterwards, whatever was mounted on it."""
    d = tempfile.mkdtemp(prefix="kxlb mounts ")
    try:
        yield d
    finally:
        while subprocess.run(["umount", d], capture_output=True).returncode == 0:
            pass
        os.rmdir(d)


def test_mount_bpffs_mounts_once_and_the_pins_work(mountpoint):
    assert fstype(mountpoint) != "bpf"
    assert mount_bpffs(mountpoint) is True
    assert fstype(mountpoint) == "bpf" and fstype(os.path.join(mountpoint, "any", "pin")) == "bpf"
    assert oct(os.stat(mountpoint).st_mode & 0o777) == "0o700"   # root's, as systemd mounts it
    assert mount_bpffs(mountpoint) is False   # one there: nothing stacked on it
    mounts = [l for l in open("/proc/self/mountinfo") if l.split()[4] == mountpoint.replace(" ", "\\040")]
    assert len(mounts) == 1, mounts


def test_cli_mount_bpffs_says_what_it_did(mountpoint):
    def run():
        return subprocess.run([sys.executable, "-m", "kxlb", "mount-bpffs", mountpoint], capture_output=True, text=True)
    first, second = run(), run()
    assert first.returncode == 0 and "mounted a bpf filesystem on" in first.stdout, first
    assert second.returncode == 0 and "on a bpf filesystem already" in second.stdout, second
    missing = subprocess.run([sys.executable, "-m", "kxlb", "mount-bpffs", mountpoint + "/nope"],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_cgroup2_dir_is_the_unified_hierarchy_in_either_layout():
    got = cgroup2_dir("/sys/fs/cgroup")
    assert fstype(got) == "cgroup2"
    # v2 host: the root itself; v1 hybrid host (this machine): systemd's unified/
    want = "/sys/fs/cgroup" if fstype("/sys/fs/cgroup") == "cgroup2" else "/sys/fs/cgroup/unified"
    assert got == want
    assert cgroup2_dir(got) == got


def test_cgroup2_dir_refuses_a_directory_without_cgroup2(mountpoint):
    with pytest.raises(KxlbError, match="not the cgroup v2"):
        cgroup2_dir(mountpoint)
    with pytest.raises(KxlbError, match="does not exist"):
        cgroup2_dir(os.path.join(mountpoint, "gone"))
