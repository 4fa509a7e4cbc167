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

Limits: sock_rev is an LRU; a socket whose entry was evicted (the map is sized as
conntrack) is not found. Only the sockets of the node's network namespace
(`--netns`, else the controller's) are seen, which is where host-network processes
live.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import SockRevKey, SockRevValue, ip_to_raw, port_to_raw, raw_to_ip, raw_to_port
from kxlb.loader.maps import BpfMap
from kxlb.loader.sockdiag import SockDiag, UdpSocket

log = logging.getLogger("kxlb.controller")

_Raw = tuple[int, int]  # (address, port) as the maps store them


@dataclass(frozen=True)
class StaleSocket:
    sock: UdpSocket
    frontend: _Raw     # the VIP:port it addressed (raw)


def stale_udp_sockets(sock_rev: BpfMap, serving: dict[_Raw, frozenset[_Raw]],
                      sockets: list[UdpSocket]) -> list[StaleSocket]:
    """The sockets among ``sockets`` that the hooks translated to a backend that is not
    serving its frontend any more (``serving``: controller/conntrack.py's
    serving_by_frontend())."""
    out = []
    for s in sockets:
        peer = s.peer_v4
        if peer is None:
            continue
        key = SockRevKey(cookie=s.cookie, addr=ip_to_raw(peer), port=port_to_raw(s.dport))
        rv: SockRevValue | None = sock_rev.get(key)
        if rv is None:
            continue
        fe = (rv.vip, rv.port)
        allowed = serving.get(fe)
        if allowed is None or (key.addr, key.port) in allowed:
            continue
        out.append(StaleSocket(s, fe))
    return out


class UdpSocketReaper:
    """Destroys the stale sockets of namespace ``ns`` after a sync; counts them in
    ``kxlb_udp_sockets_destroyed_total`` (registered in ``registry``, if given)."""

    def __init__(self, pin_dir: str, ns: str | None = None, registry=None):
        self.sock_rev_path = os.path.join(pin_dir, "sock_rev")
        self.sock_rev: BpfMap | None = None  # opened on first use: a sync that removes no UDP endpoint needs none
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
        if self.sock_rev is not None:
            self.sock_rev.close()
            self.sock_rev = None

    def _translated_any(self) -> bool:
        if self.sock_rev is None:
            self.sock_rev = BpfMap(self.sock_rev_path, SockRevKey, SockRevValue)
        return next(iter(self.sock_rev.keys()), None) is not None

    def reap(self, serving: dict[_Raw, frozenset[_Raw]]) -> int:
        """Destroy every stale socket; returns how many were destroyed. Raises KxlbError
        if the kernel refuses sock_diag altogether."""
        if not serving or not self._translated_any():  # the hooks translated nothing: no socket is ours
            return 0
        with SockDiag(self.ns) as diag:
            stale = stale_udp_sockets(self.sock_rev, serving, diag.connected_udp())
            n = 0
            for st in stale:
                if diag.destroy(st.sock):
                    n += 1
                    log.debug("destroyed UDP socket %s: its backend no longer serves %s:%d", st.sock.describe(),
                              raw_to_ip(st.frontend[0]), raw_to_port(st.frontend[1]))
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

