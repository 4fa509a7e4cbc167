"""Connected UDP sockets of host-network processes to endpoints that no longer serve,
destroyed after a sync: the socket-level half of kube-proxy's UDP cleanup
(controller/conntrack.py has the packet-level half).

A node's own processes reach services through the socket hooks (bpf/sock.c): a UDP
socket's connect() to a VIP is translated once, to a backend, and the socket keeps
sending there; no conntrack entry of ours is involved, so flushing conntrack does not
move it. Such a socket is destroyed instead (sock_diag SOCK_DESTROY,
loader/sockdiag.py): the application's next or pending recv()/send() fails with
ECONNABORTED, and its reconnect is translated again, to a serving backend.

Which sockets: the ones the hooks translated, known by sock_rev (socket cookie,
backend -> VIP:port), whose VIP:port is judged exactly as a conntrack flow to it: the
frontend's UDP service port is still programmed and the backend is not one of its
serving endpoints (terminating but still serving endpoints keep their sockets; sockets
of deleted services are left alone; NodePorts only while their port has serving
endpoints). TCP sockets are never touched, as kube-proxy does nothing for TCP: a
connection to a removed endpoint ends on its own (RST or timeout). A socket a process
connected straight to a pod address (no sock_rev entry) is not ours either.

IPv6 services' sockets are found the same way in sock_rev6 (an AF_INET6 socket with an
IPv6 peer); an IPv4-mapped peer is an IPv4 service's, in sock_rev.

Only the sockets of the node's network namespace (`--netns`, else the controller's)
are looked at: the only namespace whose sockets the hooks translate (bpf/sock.c,
sock_hostns). A pod's connected UDP socket, even in the hooks' cgroup, is connected to
the VIP itself; its datagrams are a tc flow, which controller/conntrack.py's cleanup
deletes, so it moves on without being destroyed.

Limits: sock_rev is an LRU; a socket whose entry was evicted (the map is sized as
conntrack) is not found. A pod's socket that a kxlb translated before it knew the
node's namespace lives in the pod's namespace and is not found either.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import (SockRevKey, SockRevKey6, SockRevValue, SockRevValue6, format_addr_port, ip6_to_c,
                                ip_to_raw, port_to_raw, raw_to_ip, raw_to_port)
from kxlb.loader.maps import BpfMap
from kxlb.loader.sockdiag import SockDiag, UdpSocket

log = logging.getLogger("kxlb.controller")

_Raw = tuple[int | bytes, int]  # (address, port) as the maps store them (IPv6: the address's bytes)


@dataclass(frozen=True)
class StaleSocket:
    sock: UdpSocket
    frontend: _Raw     # the VIP:port it addressed (raw)


def stale_udp_sockets(sock_rev: BpfMap, serving: dict[_Raw, frozenset[_Raw]],
                      sockets: list[UdpSocket], sock_rev6: BpfMap | None = None) -> list[StaleSocket]:
    """The sockets among ``sockets`` that the hooks translated to a backend that is not
    serving its frontend any more (``serving``: controller/conntrack.py's
    serving_by_frontend()); IPv6 peers are looked up in ``sock_rev6``."""
    out = []
    for s in sockets:
        peer, peer6 = s.peer_v4, s.peer_v6
        if peer is not None:
            key = SockRevKey(cookie=s.cookie, addr=ip_to_raw(peer), port=port_to_raw(s.dport))
            rv: SockRevValue | SockRevValue6 | None = sock_rev.get(key)
            backend = (key.addr, key.port)
        elif peer6 is not None and sock_rev6 is not None:
            key6 = SockRevKey6(cookie=s.cookie, addr=ip6_to_c(peer6), port=port_to_raw(s.dport))
            rv = sock_rev6.get(key6)
            backend = (bytes(key6.addr), key6.port)
        else:
            continue
        if rv is None:
            continue
        fe = (rv.vip if isinstance(rv.vip, int) else bytes(rv.vip), rv.port)
        allowed = serving.get(fe)
        if allowed is None or backend in allowed:
            continue
        out.append(StaleSocket(s, fe))
    return out


def _frontend_text(fe: _Raw) -> str:
    addr = raw_to_ip(fe[0]) if isinstance(fe[0], int) else socket.inet_ntop(socket.AF_INET6, fe[0])
    return format_addr_port(addr, raw_to_port(fe[1]))


class UdpSocketReaper:
    """Destroys the stale sockets of namespace ``ns`` after a sync; counts them in
    ``kxlb_udp_sockets_destroyed_total`` (registered in ``registry``, if given)."""

    def __init__(self, pin_dir: str, ns: str | None = None, registry=None):
        self.sock_rev_path = os.path.join(pin_dir, "sock_rev")
        self.sock_rev: BpfMap | None = None  # opened on first use: a sync that removes no UDP endpoint needs none
        self.sock_rev6: BpfMap | None = None
        self.ns = ns
        self.destroyed_total = 0
        self._counter = None
        self._failing = False
        if registry is not None:
            from prometheus_client import Counter

            self._counter = Counter("kxlb_udp_sockets_destroyed_total",
                                    "Connected UDP sockets of host-network processes to endpoints no longer serving, "
                                    "destroyed (sock_diag SOCK_DESTROY)", registry=registry)

    def close(self) -> None:
        for m in (self.sock_rev, self.sock_rev6):
            if m is not None:
                m.close()
        self.sock_rev = self.sock_rev6 = None

    def _translated_any(self) -> bool:
        if self.sock_rev is None:
            self.sock_rev = BpfMap(self.sock_rev_path, SockRevKey, SockRevValue)
            self.sock_rev6 = BpfMap(self.sock_rev_path + "6", SockRevKey6, SockRevValue6)
        return any(next(iter(m.keys()), None) is not None for m in (self.sock_rev, self.sock_rev6))

    def reap(self, serving: dict[_Raw, frozenset[_Raw]]) -> int:
        """Destroy every stale socket; returns how many were destroyed. Raises KxlbError
        if the kernel refuses sock_diag altogether."""
        if not serving or not self._translated_any():  # the hooks translated nothing: no socket is ours
            return 0
        with SockDiag(self.ns) as diag:
            stale = stale_udp_sockets(self.sock_rev, serving, diag.connected_udp(), self.sock_rev6)
            n = 0
            for st in stale:
                if diag.destroy(st.sock):
                    n += 1
                    log.debug("destroyed UDP socket %s: its backend no longer serves %s", st.sock.describe(),
                              _frontend_text(st.frontend))
        self.destroyed_total += n
        if self._counter is not None and n:
            self._counter.inc(n)
        return n

    def reap_logged(self, serving: dict[_Raw, frozenset[_Raw]]) -> int:
        """reap() for the sync loop: a failure is logged (once while it lasts), never
        raised: the maps are already right, only the sockets' nudge is missing."""
        try:
            n = self.reap(serving)
        except (KxlbError, OSError) as exc:
            if not self._failing:
                log.warning("cannot destroy UDP sockets of removed endpoints: %s", exc)
            self._failing = True
            return 0
        self._failing = False
        return n

