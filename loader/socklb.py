"""Socket-level service translation (bpf/sock.c) for a cgroup's processes: the node's
own, host-network processes, whose packets never cross a tc ingress hook. AF_INET
sockets use the *4 hooks; dual-stack AF_INET6 sockets addressing an IPv4 service as
::ffff:a.b.c.d use the *6 ones (connect, getpeername, recvmsg; their unconnected
sendto() reaches the kernel's IPv4 path and so the sendmsg4 hook)."""
from __future__ import annotations

import json
import os
import subprocess

from . import bpfsys
from .compile import BPF_DIR, compile_source
from .errors import KxlbError

SOURCE = BPF_DIR / "sock.c"
HOOKS = {  # program -> attach type name in bcc.BPFAttachType
    "kxlb_connect4": "CGROUP_INET4_CONNECT",
    "kxlb_sendmsg4": "CGROUP_UDP4_SENDMSG",
    "kxlb_recvmsg4": "CGROUP_UDP4_RECVMSG",
    "kxlb_getpeername4": "CGROUP_INET4_GETPEERNAME",
    "kxlb_connect6": "CGROUP_INET6_CONNECT",
    "kxlb_sendmsg6": "CGROUP_UDP6_SENDMSG",
    "kxlb_recvmsg6": "CGROUP_UDP6_RECVMSG",
    "kxlb_getpeername6": "CGROUP_INET6_GETPEERNAME",
}


# Pinned beside the maps (prog_connect4, ...), so a controller restarting with the same
# build attaches them to a cgroup without compiling again (loader/datapath.py).
PROG_PINS = {name: "prog_" + name.removeprefix("kxlb_") for name in HOOKS}
ATTACH_TYPES = {"CGROUP_INET4_CONNECT": 10, "CGROUP_INET6_CONNECT": 11, "CGROUP_UDP4_SENDMSG": 14,
                "CGROUP_UDP6_SENDMSG": 15, "CGROUP_UDP4_RECVMSG": 19, "CGROUP_UDP6_RECVMSG": 20,
                "CGROUP_INET4_GETPEERNAME": 29, "CGROUP_INET6_GETPEERNAME": 30}  # enum bpf_attach_type


def compile_sock(pin_dir: str, extra_cflags: list[str] | None = None) -> dict[str, int]:
    """Compile sock.c against the maps pinned in ``pin_dir``, load its hooks and pin them
    there; returns program name -> fd (kept open by the BCC module, kept alive here)."""
    from bcc import BPF

    bpf = compile_source(SOURCE, pin_dir, extra_cflags)
    fds = {}
    try:
        for name, hook in HOOKS.items():
            fn = bpf.load_func(name.encode(), BPF.CGROUP_SOCK_ADDR, attach_type=ATTACH_TYPES[hook])
            fds[name] = fn.fd
    except Exception as exc:
        raise KxlbError(f"the kernel rejected the socket hooks: {exc}") from None
    for name, fd in fds.items():
        pin = os.path.join(pin_dir, PROG_PINS[name])
        if os.path.lexists(pin):
            os.unlink(pin)
        bpfsys.obj_pin(fd, pin)
    _KEEP.append(bpf)
    return fds


_KEEP: list = []  # BCC modules whose program fds callers still use


def pinned_sock_programs(pin_dir: str) -> dict[str, int] | None:
    """The pinned socket hooks of ``pin_dir`` as fresh fds (None if any is missing)."""
    fds = {}
    for name, pin in PROG_PINS.items():
        try:
            fds[name] = bpfsys.obj_get(os.path.join(pin_dir, pin))
        except OSError:
            for fd in fds.values():
                os.close(fd)
            return None
    return fds


def attach_sock_programs(fds: dict[str, int], cgroup: str) -> None:
    """Attach the hooks to the cgroup v2 directory ``cgroup`` (replacing ours there)."""
    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, hook in HOOKS.items():
            ret = bpfsys.lib().bpf_prog_attach(fds[name], cg, ATTACH_TYPES[hook], 0)
            if ret < 0:
                raise KxlbError(f"attaching socket hook {name} to cgroup {cgroup}: {os.strerror(-ret)}")
    finally:
        os.close(cg)


def attach_socket_lb(pin_dir: str, cgroup: str) -> None:
    """Attach the socket hooks to the cgroup v2 directory ``cgroup``: the pinned ones of
    ``pin_dir``, compiled against its maps first if it has none. Attaching again
    replaces our programs. The attachment outlives this process (the cgroup holds the
    programs) and is recorded, so `kxlb unload` finds it again."""
    from .registry import Attachment, Registry

    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    fds = pinned_sock_programs(pin_dir)
    owned = fds is not None
    if fds is None:
        fds = compile_sock(pin_dir)
    try:
        attach_sock_programs(fds, cgroup)
    finally:
        if owned:
            for fd in fds.values():
                os.close(fd)
    with Registry(pin_dir, create=True) as reg:
        reg.record(Attachment(iface=cgroup, netns=None, hook="socklb"))


# bpftool names attach types one way in its JSON, another on its command line
_BPFTOOL_TYPES = {"cgroup_inet4_connect": "connect4", "cgroup_udp4_sendmsg": "sendmsg4",
                  "cgroup_udp4_recvmsg": "recvmsg4", "cgroup_inet4_getpeername": "getpeername4",
                  "cgroup_inet6_connect": "connect6", "cgroup_udp6_sendmsg": "sendmsg6",
                  "cgroup_udp6_recvmsg": "recvmsg6", "cgroup_inet6_getpeername": "getpeername6"}


def detach_socket_lb(cgroup: str) -> int:
    """Detach our hooks (by program name) from ``cgroup``, from any process; returns how
    many. A cgroup that is gone has nothing attached."""
    if not os.path.isdir(cgroup):
        return 0
    r = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup], capture_output=True, text=True)
    if r.returncode != 0:
        raise KxlbError(f"bpftool cgroup show {cgroup}: {r.stderr.strip()}")
    n = 0
    for prog in json.loads(r.stdout.strip() or "[]"):
        if prog.get("name") in HOOKS and prog.get("attach_type") in _BPFTOOL_TYPES:
            d = subprocess.run(["bpftool", "cgroup", "detach", cgroup, _BPFTOOL_TYPES[prog["attach_type"]],
                                "id", str(prog["id"])], capture_output=True, text=True)
            if d.returncode != 0:
                raise KxlbError(f"detaching {prog['name']} from {cgroup}: {d.stderr.strip()}")
            n += 1
    return n
