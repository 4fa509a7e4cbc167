"""Load, attach, detach and unload the datapath: the loader's public operations."""
from __future__ import annotations

import os
import shutil

from . import attach
from .attach import Attachment, Registry
from .compile import Datapath, compile_datapath
from .errors import KxlbError
from .maps import PIN_NAMES

BPF_FS_TYPE = "bpf"


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise KxlbError(f"{what} needs root (CAP_BPF, CAP_NET_ADMIN)")


def require_bpffs(pin_dir: str) -> None:
    """The pin directory must live on a bpf filesystem."""
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, typ, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (pin_dir == mnt or pin_dir.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    if fstype != BPF_FS_TYPE:
        raise KxlbError(f"{pin_dir} is not on a bpf filesystem (mount one: mount -t bpf bpf /sys/fs/bpf)")


def load(ifaces: list[str], ns: str | None = None, xdp_mode: str | None = None,
         pin_dir: str = "/sys/fs/bpf/kxlb") -> list[Attachment]:
    """Compile once (maps: create or adopt the pinned ones) and attach on each of
    ``ifaces``. ``xdp_mode`` None attaches at tc ingress, else XDP in 'generic' or
    'native' mode. Idempotent: attaching again replaces our program, and the other hook
    is removed."""
    require_root("kxlb load")
    require_bpffs(pin_dir)
    from .netns import netns_path
    netns_path(ns)  # fail on a missing namespace before compiling
    dp = compile_datapath(pin_dir)
    return [attach_one(dp, iface, ns, xdp_mode, pin_dir) for iface in ifaces]


def attach_one(dp: Datapath, iface: str, ns: str | None, xdp_mode: str | None, pin_dir: str) -> Attachment:
    """Attach an already compiled datapath on one interface and record it."""
    if xdp_mode:
        attach.attach_xdp(ns, iface, dp.xdp_fd, xdp_mode)
        attach.detach_tc(ns, iface)
        a = Attachment(iface=iface, netns=ns, hook="xdp", mode=xdp_mode)
    else:
        attach.attach_tc(ns, iface, dp.tc_fd)
        if attach.xdp_attached(ns, iface):
            attach.detach_xdp(ns, iface)
        a = Attachment(iface=iface, netns=ns, hook="tc")
    attach.accept_local(ns, iface)
    reg = Registry(pin_dir)
    reg.save([x for x in reg.load() if (x.iface, x.netns) != (iface, ns)] + [a])
    return a


def _detach(a: Attachment, missing_ok: bool) -> None:
    try:
        if a.hook == "socklb":
            from .socklb import detach_socket_lb
            detach_socket_lb(a.iface)
        elif a.hook == "xdp":
            attach.detach_xdp(a.netns, a.iface)
        else:
            attach.detach_tc(a.netns, a.iface)
    except KxlbError:
        if not missing_ok:
            raise


def unload(pin_dir: str = "/sys/fs/bpf/kxlb", iface: str | None = None, ns: str | None = None) -> list[Attachment]:
    """Detach from ``iface`` (in ``ns``), or, without ``iface``, from everywhere and
    remove the pinned maps too. Idempotent. Returns what was detached."""
    require_root("kxlb unload")
    reg = Registry(pin_dir)
    items = reg.load()
    if iface:
        gone = [a for a in items if (a.iface, a.netns) == (iface, ns)] or [Attachment(iface, ns, "tc")]
        for a in gone:
            _detach(a, missing_ok=False)
        if attach.xdp_attached(ns, iface):
            attach.detach_xdp(ns, iface)
        reg.save([a for a in items if (a.iface, a.netns) != (iface, ns)])
        return gone
    for a in items:
        _detach(a, missing_ok=True)  # an interface or namespace may be gone already
    reg.remove()
    for name in PIN_NAMES:
        try:
            os.unlink(os.path.join(pin_dir, name))
        except FileNotFoundError:
            pass
    if os.path.isdir(pin_dir):
        try:
            os.rmdir(pin_dir)
        except OSError:
            shutil.rmtree(pin_dir, ignore_errors=True)
    return items
