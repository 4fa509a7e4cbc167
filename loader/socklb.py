"""Socket-level service translation (bpf/sock.c) for a cgroup's processes: the node's
own, host-network processes, whose packets never cross a tc ingress hook. AF_INET
sockets use the *4 hooks; dual-stack AF_INET6 sockets addressing an IPv4 service as
::ffff:a.b.c.d use the *6 ones (connect, getpeername, recvmsg; their unconnected
sendto() reaches the kernel's IPv4 path and so the sendmsg4 hook).

**The host's sockets only.** The cgroup (the root one on a real node) holds the pods'
processes too. A pod's socket translated here would be judged as the node
(loadBalancerSourceRanges, affinity), and its connected UDP sockets would outlive a
removed endpoint: sock_diag sees only the node's namespace, and no conntrack entry
exists to flush. So the hooks translate the sockets of one network namespace, the
host's (the node's: ``--netns``, else the caller's), which the programs know by its
cookie (``sock_hostns``, a map of each build, written here before its hooks are
attached). A pod's packets cross the tc hook on its veth instead, and are judged there
by their real source, with conntrack and its UDP cleanup, as kube-proxy judges them.

**Good neighbour.** Every hook is attached with BPF_F_ALLOW_MULTI: another tool's
programs on the same cgroup and attach type keep running beside ours, and tools below
the cgroup may attach theirs (an exclusive program at the root would forbid every
cgroup of the node to). Ours is replaced in place (BPF_F_REPLACE, naming the program it
replaces: the run order of the others is kept), never added twice; another tool's
program attached without ALLOW_MULTI is never replaced: the attach is refused, naming
it. Detaching removes our programs only.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
from functools import lru_cache

from . import bpfsys
from .attach import _ProgInfo, _prog_fd_by_id, prog_ref, prog_ref_by_id
from .compile import BPF_DIR, compile_source
from .errors import KxlbError
from .netns import netns as in_netns

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

BPF_F_ALLOW_OVERRIDE, BPF_F_ALLOW_MULTI, BPF_F_REPLACE = 1, 2, 4
SO_NETNS_COOKIE = 71        # asm-generic/socket.h (Linux 5.14); Python's socket module lacks it
HOSTNS_MAP = b"sock_hostns"  # bpf/sock.c: the host namespace's cookie, key 0
NAME_LEN = 15               # the kernel keeps 15 characters of a program's name


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()
"""attach_socket_lb(netns=KEEP): the hooks keep the host namespace they have (carried
over from the programs they replace); unset, they translate every namespace's sockets,
as kxlb did before it knew the host's."""


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


# --- the host's network namespace -----------------------------------------------------------
def netns_cookie(ns: str | None) -> int:
    """The cookie of network namespace ``ns`` (None: the caller's), the number
    bpf_get_netns_cookie() gives the hooks for a socket of that namespace."""
    with in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a socket belongs to the namespace it was made in
    try:
        raw = s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8)
    except OSError as exc:
        raise KxlbError(f"cannot read the cookie of network namespace {ns or '(ours)'}: {exc.strerror} "
                        "(SO_NETNS_COOKIE needs Linux 5.14)") from None
    finally:
        s.close()
    return int.from_bytes(raw, sys.byteorder)


def _map_ids(prog_fd: int) -> list[int]:
    """The ids of the maps a program uses."""
    info = _ProgInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    bpfsys.check(bpfsys.lib().bpf_obj_get_info_by_fd(prog_fd, ctypes.byref(info), ctypes.byref(size)),
                 "program info")
    if not info.nr_map_ids:
        return []
    ids = (ctypes.c_uint32 * info.nr_map_ids)()
    again = _ProgInfo(nr_map_ids=info.nr_map_ids, map_ids=ctypes.addressof(ids))
    size = ctypes.c_uint32(ctypes.sizeof(again))
    bpfsys.check(bpfsys.lib().bpf_obj_get_info_by_fd(prog_fd, ctypes.byref(again), ctypes.byref(size)),
                 "program info")
    return list(ids[:min(info.nr_map_ids, again.nr_map_ids)])


def _hostns_maps(prog_fds) -> list[int]:
    """Fds of the sock_hostns maps the programs use (one per build; none for the hooks of
    a kxlb that did not have it). The caller closes them."""
    out, seen = [], set()
    for fd in prog_fds:
        for mid in _map_ids(fd):
            if mid in seen:
                continue
            seen.add(mid)
            mfd = bpfsys.map_fd_by_id(mid)
            if bpfsys.map_info(mfd).name == HOSTNS_MAP:
                out.append(mfd)
            else:
                os.close(mfd)
    return out


def _hostns_cookie(map_fd: int) -> int:
    key, value = ctypes.c_uint32(0), ctypes.c_uint64()
    bpfsys.check(bpfsys.lib().bpf_map_lookup_elem(map_fd, ctypes.byref(key), ctypes.byref(value)),
                 "read sock_hostns")
    return value.value


def host_netns_of(prog_fds) -> int:
    """The host namespace's cookie the programs translate for (0: unset, every namespace)."""
    maps = _hostns_maps(prog_fds)
    try:
        return next((c for c in map(_hostns_cookie, maps) if c), 0)
    finally:
        for fd in maps:
            os.close(fd)


def set_host_netns(prog_fds, cookie: int) -> None:
    """Make the programs translate the sockets of the namespace whose cookie is ``cookie``
    only. Done before they are attached: a hook never runs without it."""
    maps = _hostns_maps(prog_fds)
    try:
        if not maps:
            raise KxlbError("the socket hooks have no sock_hostns map: they were built by an older kxlb")
        for fd in maps:
            bpfsys.check(bpfsys.lib().bpf_map_update_elem(fd, ctypes.byref(ctypes.c_uint32(0)),
                                                          ctypes.byref(ctypes.c_uint64(cookie)), bpfsys.BPF_ANY),
                         "write sock_hostns")
    finally:
        for fd in maps:
            os.close(fd)


# --- cgroup attachments -----------------------------------------------------------------------
class _AttachOpts(ctypes.Structure):
    """libbpf's struct bpf_prog_attach_opts as libbpf 1.1 (Debian 12's) has it; later
    releases add fields after these and read no further than ``sz``."""

    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("replace_prog_fd", ctypes.c_int)]


@lru_cache(maxsize=1)
def _libbpf() -> ctypes.CDLL:
    so = bpfsys.lib()
    u32p = ctypes.POINTER(ctypes.c_uint32)
    for fn, args in (("bpf_prog_attach_opts", [ctypes.c_int, ctypes.c_int, ctypes.c_uint32,
                                               ctypes.POINTER(_AttachOpts)]),
                     ("bpf_prog_detach2", [ctypes.c_int, ctypes.c_int, ctypes.c_uint32]),
                     ("bpf_prog_query", [ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, u32p, u32p, u32p])):
        f = getattr(so, fn)
        f.restype, f.argtypes = ctypes.c_int, args
    return so


def _query(cg: int, atype: int) -> tuple[int, list[int]]:
    """The cgroup's attach flags for ``atype`` and the ids of the programs attached to the
    cgroup itself (not inherited), in the order they run."""
    n = 16
    while True:
        flags, count, ids = ctypes.c_uint32(), ctypes.c_uint32(n), (ctypes.c_uint32 * n)()
        ret = _libbpf().bpf_prog_query(cg, atype, 0, ctypes.byref(flags), ids, ctypes.byref(count))
        if ret < 0 and -ret == errno.ENOSPC:
            n = max(count.value, 4 * n)
            continue
        bpfsys.check(ret, "query the cgroup's programs")
        return flags.value, list(ids[:count.value])


def _split(cg: int, name: str) -> tuple[int, list[int], list[str]]:
    """For the attach type of our program ``name``: the cgroup's flags, our programs' ids
    (known by name), and how the others are called in an error."""
    flags, ids = _query(cg, ATTACH_TYPES[HOOKS[name]])
    ours, others = [], []
    for pid in ids:
        ref = prog_ref_by_id(pid)
        if ref is None:
            continue  # unloaded since the query: detached with it
        if ref.name == name[:NAME_LEN]:
            ours.append(pid)
        else:
            others.append(str(ref))
    return flags, ours, others


def _ancestor_forbids(cgroup: str, name: str) -> str | None:
    """The program of a cgroup above ``cgroup`` that forbids attaching our ``name`` below
    it, as the kernel judges (hierarchy_allows_attach()): the nearest ancestor with a
    program of that attach type decides, and allows only if it attached with
    BPF_F_ALLOW_MULTI or BPF_F_ALLOW_OVERRIDE."""
    path = os.path.realpath(cgroup)
    while not os.path.ismount(path) and path != "/":
        path = os.path.dirname(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            flags, ours, others = _split(fd, name)
        finally:
            os.close(fd)
        if flags & BPF_F_ALLOW_MULTI:
            return None
        if not (ours or others):
            continue
        if flags & BPF_F_ALLOW_OVERRIDE:
            return None
        return f"cgroup {path} holds {', '.join(others) or name} on {HOOKS[name].lower()}"
    return None


def _detach_id(cg: int, atype: int, pid: int) -> None:
    try:
        fd = _prog_fd_by_id(pid)
    except OSError:
        return  # unloaded meanwhile: its attachment went with it
    try:
        ret = _libbpf().bpf_prog_detach2(fd, cg, atype)
        if ret < 0 and -ret != errno.ENOENT:  # ENOENT: detached meanwhile
            bpfsys.check(ret, f"detach program id {pid}")
    finally:
        os.close(fd)


def _attach(cg: int, atype: int, prog_fd: int, replace_id: int | None) -> int:
    """Attach with BPF_F_ALLOW_MULTI, in place of program ``replace_id`` if given; returns
    0 or the negative errno."""
    opts = _AttachOpts(sz=ctypes.sizeof(_AttachOpts), flags=BPF_F_ALLOW_MULTI)
    old = -1
    if replace_id is not None:
        try:
            old = _prog_fd_by_id(replace_id)
        except OSError:
            return -errno.ENOENT
        opts.flags |= BPF_F_REPLACE
        opts.replace_prog_fd = old
    try:
        return min(_libbpf().bpf_prog_attach_opts(prog_fd, cg, atype, ctypes.byref(opts)), 0)  # libbpf: -errno
    finally:
        if old >= 0:
            os.close(old)


def _attach_hook(cg: int, cgroup: str, name: str, prog_fd: int, new_id: int) -> None:
    """One hook: ours in place of ours, beside the others."""
    atype = ATTACH_TYPES[HOOKS[name]]
    for _ in range(3):  # a program of ours that went away between the query and the attach: look again
        flags, ours, _others = _split(cg, name)
        multi = bool(flags & BPF_F_ALLOW_MULTI)
        if new_id in ours and multi:  # already there (a restart attaching the same pinned build)
            ret = 0
        elif ours and multi:
            ret = _attach(cg, atype, prog_fd, ours[0])  # its place in the run order, atomically
        else:
            # Nothing there, or ours alone attached exclusively by a kxlb from before
            # ALLOW_MULTI: the kernel mixes no modes on one cgroup, so it goes first (the
            # hook is missing for two system calls, once).
            for pid in ours:
                _detach_id(cg, atype, pid)
            ret = _attach(cg, atype, prog_fd, None)
        if ret == -errno.ENOENT:
            continue
        if ret < 0:
            hint = (" (a program attached without BPF_F_ALLOW_MULTI to this cgroup or one above it forbids "
                    "others)" if ret == -errno.EPERM else "")
            raise KxlbError(f"attaching socket hook {name} to cgroup {cgroup}: {os.strerror(-ret)}{hint}")
        for pid in _split(cg, name)[1]:  # copies of ours beside the new one (an interrupted attach)
            if pid != new_id:
                _detach_id(cg, atype, pid)
        return
    raise KxlbError(f"attaching socket hook {name} to cgroup {cgroup}: our programs there keep changing")


def _open_cgroup(cgroup: str) -> int:
    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    return os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)


def _carry_host_netns(replaced: list[int], fds: dict[str, int]) -> None:
    """Give ``fds``' programs the host namespace of the first of ours they replace that has
    one (all of a build share one sock_hostns)."""
    for pid in replaced:
        try:
            old = _prog_fd_by_id(pid)
        except OSError:
            continue  # unloaded meanwhile
        try:
            cookie = host_netns_of([old])
        finally:
            os.close(old)
        if cookie:
            set_host_netns(fds.values(), cookie)
            return


def attach_sock_programs(fds: dict[str, int], cgroup: str) -> None:
    """Attach the hooks to the cgroup v2 directory ``cgroup``, each in place of ours there
    (an earlier build's) and beside other tools' programs. Nothing changes when another
    tool's program holds a hook's attach type without BPF_F_ALLOW_MULTI: we would have to
    replace it. Programs whose host namespace is unset take the one of the programs they
    replace (an upgrade: loader/datapath.py switches every cgroup to the new build)."""
    cg = _open_cgroup(cgroup)
    try:
        replaced = []
        for name in HOOKS:  # every refusal before the first change
            flags, ours, others = _split(cg, name)
            if others and not flags & BPF_F_ALLOW_MULTI:
                raise KxlbError(f"cgroup {cgroup}: {HOOKS[name].lower()} holds another tool's program, attached "
                                f"without BPF_F_ALLOW_MULTI ({', '.join(others)}): kxlb does not replace it; "
                                f"detach it, or attach it with BPF_F_ALLOW_MULTI")
            above = _ancestor_forbids(cgroup, name)
            if above:
                raise KxlbError(f"cannot attach the socket hooks to cgroup {cgroup}: {above}, attached without "
                                f"BPF_F_ALLOW_MULTI, which forbids every cgroup below it to attach that type")
            replaced += ours
        if not host_netns_of(fds.values()):
            _carry_host_netns(replaced, fds)
        for name in HOOKS:
            _attach_hook(cg, cgroup, name, fds[name], prog_ref(fds[name]).id)
    finally:
        os.close(cg)


def attach_socket_lb(pin_dir: str, cgroup: str, netns: str | None | _Keep = KEEP) -> None:
    """Attach the socket hooks to the cgroup v2 directory ``cgroup``: the pinned ones of
    ``pin_dir``, compiled against its maps first if it has none. They translate the
    sockets of network namespace ``netns`` only (an ``ip netns`` name or a path; None:
    the caller's): the node's, where its host-network processes live, as the
    controller's ``--netns`` names it. KEEP, for a caller that does not know it: the
    namespace the hooks already have (none: every namespace's sockets). Attaching again
    replaces our programs. The attachment outlives this process (the cgroup holds the
    programs) and is recorded, so `kxlb unload` finds it again."""
    from .registry import Attachment, Registry

    if not os.path.isdir(cgroup):
        raise KxlbError(f"cgroup {cgroup} does not exist (a cgroup v2 directory is needed)")
    cookie = None if isinstance(netns, _Keep) else netns_cookie(netns)
    fds = pinned_sock_programs(pin_dir)
    owned = fds is not None
    if fds is None:
        fds = compile_sock(pin_dir)
    try:
        if cookie is not None:
            set_host_netns(fds.values(), cookie)
        attach_sock_programs(fds, cgroup)
    finally:
        if owned:
            for fd in fds.values():
                os.close(fd)
    with Registry(pin_dir, create=True) as reg:
        if isinstance(netns, _Keep):
            old = next((a for a in reg.attachments() if a.hook == "socklb" and a.iface == cgroup), None)
            netns = old.netns if old is not None else None
        reg.record(Attachment(iface=cgroup, netns=netns, hook="socklb"))


def make_exclusive(cgroup: str) -> list[str]:
    """For a roll back to kxlb 0.1, which attaches its hooks exclusively (flags 0): the
    kernel refuses that beside programs attached with BPF_F_ALLOW_MULTI, ours included. Our
    programs are attached again exclusively (each hook missing for two system calls), so
    the older release's attach replaces them. Returns notes: a hook another tool's
    program shares stays as it is (the older release cannot attach there at all)."""
    notes = []
    cg = _open_cgroup(cgroup)
    try:
        for name, hook in HOOKS.items():
            atype = ATTACH_TYPES[hook]
            flags, ours, others = _split(cg, name)
            if not ours or not flags & BPF_F_ALLOW_MULTI:
                continue
            if others:
                notes.append(f"cgroup {cgroup}: {hook.lower()} is shared with {', '.join(others)}: left as it is")
                continue
            fd = _prog_fd_by_id(ours[0])
            try:
                for pid in ours:
                    _detach_id(cg, atype, pid)
                bpfsys.check(_libbpf().bpf_prog_attach(fd, cg, atype, 0), f"attach {name} to {cgroup}")
            finally:
                os.close(fd)
    finally:
        os.close(cg)
    return notes


def detach_socket_lb(cgroup: str) -> int:
    """Detach our hooks (by program name) from ``cgroup``, from any process, leaving
    other tools' programs attached; returns how many. A cgroup that is gone has nothing
    attached."""
    if not os.path.isdir(cgroup):
        return 0
    try:
        cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return 0
    n = 0
    try:
        for name, hook in HOOKS.items():
            try:
                for pid in _split(cg, name)[1]:
                    _detach_id(cg, ATTACH_TYPES[hook], pid)
                    n += 1
            except OSError as exc:
                raise KxlbError(f"detaching {name} from {cgroup}: {exc.strerror}") from None
    finally:
        os.close(cg)
    return n
