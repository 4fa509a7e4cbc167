"""Socket-level service translation (bpf/sock.c) for a cgroup's processes: the node's
own, host-network processes, whose packets never cross a tc ingress hook. AF_INET
sockets use the *4 hooks; dual-stack AF_INET6 sockets addressing an IPv4 service as
::ffff:a.b.c.d use the *6 ones (connect, getpeername, recvmsg; their unconnected
sendto() reaches the kernel's IPv4 path and so the sendmsg4 hook)."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

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


@dataclass
class SocketLB:
    bpf: object
    cgroup: str
    cgroup_fd: int

    def detach(self) -> None:
        from bcc import BPF, BPFAttachType

        for name, hook in HOOKS.items():
            fn = self.bpf.funcs.get(name.encode())
            if fn is not None:
                try:
                    BPF.detach_func(fn, self.cgroup_fd, getattr(BPFAttachType, hook))
                except Exception:
                    pass
        os.close(self.cgroup_fd)


def attach_socket_lb(pin_dir: str, cgroup: str) -> SocketLB:
    """Compile sock.c against the pinned maps of ``pin_dir`` and attach its hooks (HOOKS) to
    the cgroup v2 directory ``cgroup``. Attaching again replaces our programs. The
    attachment outlives this process (the cgroup holds the programs)."""
    from bcc import BPF, BPFAttachType

    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    bpf = compile_source(SOURCE, pin_dir)
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, hook in HOOKS.items():
            atype = getattr(BPFAttachType, hook)
            fn = bpf.load_func(name.encode(), BPF.CGROUP_SOCK_ADDR, attach_type=atype)
            BPF.attach_func(fn, fd, atype)
    except Exception as exc:
        os.close(fd)
        raise KxlbError(f"attaching socket hooks to cgroup {cgroup}: {exc}") from None
    from .attach import Attachment, Registry  # recorded, so `kxlb unload` finds them again

    reg = Registry(pin_dir)
    reg.save([a for a in reg.load() if (a.hook, a.iface) != ("socklb", cgroup)]
             + [Attachment(iface=cgroup, netns=None, hook="socklb")])
    return SocketLB(bpf, cgroup, fd)


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
