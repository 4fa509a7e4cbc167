"""Which file system holds a path, and the two the datapath needs: a bpf filesystem for
the pins and the cgroup v2 hierarchy for the socket hooks.

Nodes differ here. systemd mounts bpffs at boot, kind's nodes do not; a cgroup v2 host
mounts the unified hierarchy at /sys/fs/cgroup, a v1 "hybrid" host (systemd's layout)
at /sys/fs/cgroup/unified under a tmpfs of v1 controllers. One DaemonSet serves both:
its init container mounts bpffs where none is (``kxlb mount-bpffs``), and ``--cgroup``
/sys/fs/cgroup finds the v2 hierarchy in either layout (``cgroup2_dir``).
"""
from __future__ import annotations

import ctypes
import errno
import os

from .errors import KxlbError

BPF_FS_TYPE = "bpf"
CGROUP2_FS_TYPE = "cgroup2"
MOUNTINFO = "/proc/self/mountinfo"


def fstype(path: str, mountinfo: str = MOUNTINFO) -> str | None:
    """The file system type of the mount that holds *path*: among the mount points above
    it, the longest one whose device is *path*'s own (a mount hidden under a later one on
    a parent directory has another device); by length alone when *path* cannot be
    stat()ed. The last listed wins a tie: it is mounted over the others. None: no mount
    holds it (a path outside this mount namespace's view)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        dev: str | None = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    except OSError:
        dev = None
    found: dict[bool, tuple[int, str | None]] = {True: (-1, None), False: (-1, None)}
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            mnt = _unescape(fields[4])
            if not (real == mnt or real.startswith(mnt.rstrip("/") + "/")):
                continue
            same_dev = fields[2] == dev
            if len(mnt) >= found[same_dev][0]:
                found[same_dev] = (len(mnt), fields[fields.index("-") + 1])
    return found[True][1] if found[True][1] is not None else found[False][1]


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def require_bpffs(pin_dir: str) -> None:
    """The pin directory must live on a bpf filesystem."""
    if fstype(pin_dir) != BPF_FS_TYPE:
        raise KxlbError(f"{pin_dir} is not on a bpf filesystem (mount one: mount -t bpf bpf /sys/fs/bpf, "
                        f"or `kxlb mount-bpffs`)")


def mount_bpffs(path: str) -> bool:
    """Mount a bpf filesystem on *path* unless one holds it already; True if mounted here.
    Mode 0700, as systemd mounts it: the pins are root's. In a pod the mount reaches the
    node only through a Bidirectional volume (deploy/base: the init container)."""
    if not os.path.isdir(path):
        raise KxlbError(f"{path} does not exist (the bpf filesystem's mount point must be a directory)")
    if fstype(path) == BPF_FS_TYPE:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", os.fsencode(path), b"bpf", 0, b"mode=0700") != 0:
        err = ctypes.get_errno()
        hint = " (needs CAP_SYS_ADMIN in the initial user namespace)" if err == errno.EPERM else ""
        raise KxlbError(f"mounting a bpf filesystem on {path}: {os.strerror(err)}{hint}")
    return True


def cgroup2_root(mountinfo: str = MOUNTINFO) -> str | None:
    """Where the unified cgroup hierarchy is mounted (the first cgroup2 mount; None: none)."""
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == CGROUP2_FS_TYPE:
                return _unescape(fields[4])
    return None


def cgroup2_dir(cgroup: str, mountinfo: str = MOUNTINFO) -> str:
    """The cgroup v2 directory ``--cgroup`` means: *cgroup* itself when it is on the
    unified hierarchy, else its ``unified`` child when that is, where systemd's hybrid
    layout mounts v2 (attaching to the v1 tmpfs above it fails with EBADF)."""
    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    if fstype(cgroup, mountinfo) == CGROUP2_FS_TYPE:
        return cgroup
    unified = os.path.join(cgroup, "unified")
    if os.path.isdir(unified) and fstype(unified, mountinfo) == CGROUP2_FS_TYPE:
        return unified
    raise KxlbError(f"cgroup {cgroup} is on {fstype(cgroup, mountinfo)}, not the cgroup v2 (unified) hierarchy, "
                    f"and has no unified/ that is: give --cgroup a cgroup2 directory")
