"""Socket-level service translation (bpf/sock.c) for a cgroup's processes: the node's
own, host-network processes, whose packets never cross a tc ingress hook."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .compile import BPF_DIR, compile_source
from .errors import KxlbError

SOURCE = BPF_DIR / "sock.c"
HOOKS = {  # program -> attach type name in bcc.BPFAttachType
    "kxlb_connect4": "CGROUP_INET4_CONNECT",
    "kxlb_sendmsg4": "CGROUP_UDP4_SENDMSG",
    "kxlb_recvmsg4": "CGROUP_UDP4_RECVMSG",
    "kxlb_getpeername4": "CGROUP_INET4_GETPEERNAME",
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
    """Compile sock.c against the pinned maps of ``pin_dir`` and attach its four hooks to
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
    return SocketLB(bpf, cgroup, fd)
