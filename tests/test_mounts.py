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
from kxlb.loader.mounts import cgroup2_dir, cgroup2_root, fstype, mount_bpffs


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


def statfs_type(path: str) -> str:
    """coreutils' name of the file system under *path* (statfs(2), not mountinfo)."""
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()


def test_cgroup2_dir_is_the_unified_hierarchy_in_either_layout():
    got = cgroup2_dir("/sys/fs/cgroup")
    assert statfs_type(got) == "cgroup2fs"
    # v2 host: the root itself; v1 hybrid host (this machine): systemd's unified/
    want = "/sys/fs/cgroup" if statfs_type("/sys/fs/cgroup") == "cgroup2fs" else "/sys/fs/cgroup/unified"
    assert got == want
    assert cgroup2_dir(got) == got
    assert cgroup2_root() == want


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:25 / /sys rw,nosuid shared:7 - sysfs sysfs rw
31 30 0:26 / /sys/fs/bpf rw shared:8 - bpf bpf rw,mode=700
32 30 0:27 / /sys/fs/bpfx rw shared:9 - tmpfs tmpfs rw
33 22 0:28 / /mnt/a\\040b rw shared:10 - bpf bpf rw
34 22 0:29 / /mnt/stack rw shared:11 - tmpfs tmpfs rw
35 22 0:30 / /mnt/stack rw shared:12 - bpf bpf rw
36 22 0:31 / /sys/fs/cgroup rw shared:13 - tmpfs tmpfs rw
37 36 0:32 / /sys/fs/cgroup/unified rw shared:14 - cgroup2 cgroup2 rw
"""


def test_fstype_reads_mountinfo_exactly(tmp_path):
    """The mount point must be a whole path component (/sys/fs/bpfx is not under
    /sys/fs/bpf), escapes are undone, the last of two mounts on one point wins (paths that
    do not exist here: by mount point alone)."""
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert fstype("/nonexistent-kx/sys/fs/bpf/pins", str(info)) == "ext4"   # only / holds it
    with_root = {p: fstype(p, str(info)) for p in ("/sys/fs/bpfx/x", "/sys/fs/bpf/x/y", "/mnt/a b/pin",
                                                   "/mnt/a", "/mnt/stack/x", "/sys/fs/cgroup/cpu")}
    assert with_root == {"/sys/fs/bpfx/x": "tmpfs", "/sys/fs/bpf/x/y": "bpf", "/mnt/a b/pin": "bpf",
                         "/mnt/a": "ext4", "/mnt/stack/x": "bpf", "/sys/fs/cgroup/cpu": "tmpfs"}
    assert cgroup2_root(str(info)) == "/sys/fs/cgroup/unified"


def test_cgroup2_dir_refuses_a_directory_without_cgroup2(mountpoint):
    with pytest.raises(KxlbError, match="not the cgroup v2"):
        cgroup2_dir(mountpoint)
    with pytest.raises(KxlbError, match="does not exist"):
        cgroup2_dir(os.path.join(mountpoint, "gone"))
