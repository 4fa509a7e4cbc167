"""Connected UDP sockets of a network namespace, listed and destroyed through the
kernel's sock_diag netlink interface (what `ss -K` does).

Why netlink and not a BPF socket iterator with the bpf_sock_destroy() kfunc (Cilium's
way): the datapath is built with BCC 0.26, which refuses a call to a kfunc ("cannot
call non-static helper function": kfunc calls need libbpf's relocation of `__ksym`
externs) and whose Python API cannot attach iterators. SOCK_DESTROY needs CONFIG_INET_DIAG_DESTROY=y and CAP_NET_ADMIN in the
sockets' namespace; the kernel then aborts the socket as the iterator would
(udp_abort(): the next or pending recv()/send() fails with ECONNABORTED and the socket
is disconnected, so the application reconnects and the socket hooks choose again).

pyroute2's DiagSocket can dump sockets but has no SOCK_DESTROY request and ignores the
kernel's error replies, so the few messages needed are built here.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterator

from .errors import KxlbError
from .netns import netns

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
TCP_ESTABLISHED = 1  # a connected UDP socket's sk_state

_NLMSGHDR = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid:
# sport, dport (big endian), src[16], dst[16], interface, cookie[2] (host order)
_REQ = struct.Struct("=BBBBI")
_SOCKID = struct.Struct(">HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
_MSG_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans, then the sockid
_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


@dataclass(frozen=True)
class UdpSocket:
    """One connected UDP socket as sock_diag reports it."""

    family: int        # AF_INET, or AF_INET6 (dual-stack sockets: IPv4 peers as ::ffff:a.b.c.d)
    src: bytes         # 16 bytes as the kernel gives them (IPv4: the first 4)
    dst: bytes
    sport: int
    dport: int
    ifindex: int
    cookie: int        # the socket cookie, as bpf_get_socket_cookie() gives it

    @property
    def peer_v4(self) -> str | None:
        """The peer's IPv4 address (also of a dual-stack socket), or None (IPv6 peer)."""
        if self.family == socket.AF_INET:
            return socket.inet_ntoa(self.dst[:4])
        if self.dst[:12] == _V4_MAPPED:
            return socket.inet_ntoa(self.dst[12:])
        return None

    @property
    def peer_v6(self) -> str | None:
        """The peer's IPv6 address (not an IPv4-mapped one), or None."""
        if self.family == socket.AF_INET6 and self.dst[:12] != _V4_MAPPED:
            return socket.inet_ntop(socket.AF_INET6, self.dst)
        return None

    def describe(self) -> str:
        fam = socket.AF_INET if self.family == socket.AF_INET else socket.AF_INET6
        n = 4 if fam == socket.AF_INET else 16
        return (f"{socket.inet_ntop(fam, self.src[:n])}:{self.sport} -> "
                f"{socket.inet_ntop(fam, self.dst[:n])}:{self.dport} (cookie {self.cookie})")

    def _sockid(self) -> bytes:
        return _SOCKID.pack(self.sport, self.dport, self.src, self.dst) + \
            _SOCKID_TAIL.pack(self.ifindex, self.cookie & 0xffffffff, self.cookie >> 32)


def _request(family: int, states: int, sockid: bytes) -> bytes:
    return _REQ.pack(family, socket.IPPROTO_UDP, 0, 0, states) + sockid


class SockDiag:
    """A sock_diag netlink socket in network namespace ``ns`` (None: ours). The socket
    keeps its namespace after we leave it (loader/netns.py), so it can be used from any
    thread."""

    def __init__(self, ns: str | None = None):
        with netns(ns):
            self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
        self.sock.bind((0, 0))
        self.ns = ns
        self._seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SockDiag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, msg_type: int, flags: int, body: bytes) -> int:
        self._seq += 1
        self.sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, self._seq, 0) + body)
        return self._seq

    def _replies(self, seq: int) -> Iterator[tuple[int, bytes]]:
        """(type, payload) of the replies to request ``seq``, until DONE or an ACK/error
        (raised as OSError)."""
        while True:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, typ, _flags, mseq, _pid = _NLMSGHDR.unpack_from(data, off)
                if length < _NLMSGHDR.size:
                    return
                payload = data[off + _NLMSGHDR.size:off + length]
                off += (length + 3) & ~3
                if mseq != seq:
                    continue
                if typ == NLMSG_DONE:
                    return
                if typ == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", payload)
                    if err:
                        raise OSError(-err, os.strerror(-err))
                    return
                yield typ, payload

    def connected_udp(self) -> list[UdpSocket]:
        """Every connected UDP socket of the namespace, both families."""
        out = []
        for family in (socket.AF_INET, socket.AF_INET6):
            seq = self._send(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                             _request(family, 1 << TCP_ESTABLISHED, bytes(_SOCKID.size + _SOCKID_TAIL.size)))
            try:
                for _typ, p in self._replies(seq):
                    fam = _MSG_HEAD.unpack_from(p)[0]
                    sport, dport, src, dst = _SOCKID.unpack_from(p, _MSG_HEAD.size)
                    ifindex, c0, c1 = _SOCKID_TAIL.unpack_from(p, _MSG_HEAD.size + _SOCKID.size)
                    out.append(UdpSocket(fam, src, dst, sport, dport, ifindex, c0 | c1 << 32))
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno in (errno.ENOENT, errno.EAFNOSUPPORT):
                    continue  # a kernel without IPv6
                raise KxlbError(f"listing UDP sockets (sock_diag) in namespace {self.ns or 'of kxlb'}: "
                                f"{exc.strerror}") from None
        return out

    def destroy(self, s: UdpSocket) -> bool:
        """Abort socket ``s`` (its 4-tuple and cookie must still match): True if
        destroyed, False if it is gone already. Errors that would hit every socket
        (no CAP_NET_ADMIN, a kernel without CONFIG_INET_DIAG_DESTROY) raise KxlbError."""
        seq = self._send(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, _request(s.family, 0xffffffff, s._sockid()))
        try:
            for _ in self._replies(seq):
                pass
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            hint = {errno.EOPNOTSUPP: " (the kernel lacks CONFIG_INET_DIAG_DESTROY)",
                    errno.EPERM: " (needs CAP_NET_ADMIN in that namespace)"}.get(exc.errno, "")
            raise KxlbError(f"destroying UDP socket {s.describe()}: {exc.strerror}{hint}") from None
        return True
