"""Conntrack as user space sees it: the one Python module that knows how ct_map holds a
flow (bpf/maps.h struct ct_entry, bpf/ct.h). The CLI lists flows with it, the controller
deletes stale UDP flows with it, tests read flows with it.

A flow has two entries with the same value: FWD keyed client -> frontend, REV keyed by
the translated 4-tuple backend <-> source in canonical order. Either entry rebuilds the
other's key; deleting a flow deletes both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from .layout import C, PROTO_NAMES, CtEntry, CtKey, raw_to_ip, raw_to_port
from .maps import Maps

CLOCK = 6  # CLOCK_MONOTONIC_COARSE (Linux): the datapath's bpf_ktime_get_coarse_ns()
NSEC = 1_000_000_000
FWD, REV = C["CT_DIR_FWD"], C["CT_DIR_REV"]
_CLOSING = C["CT_F_FIN_FWD"] | C["CT_F_FIN_REV"]

FLAG_NAMES = {C["CT_F_REPLIED"]: "replied", C["CT_F_FIN_FWD"]: "fin-client", C["CT_F_FIN_REV"]: "fin-backend",
              C["CT_F_RST"]: "rst", C["CT_F_SNAT"]: "masqueraded", C["CT_F_REMAP"]: "port-remapped"}


def now_ns() -> int:
    """The datapath's clock."""
    return time.clock_gettime_ns(CLOCK)


def closing(flags: int) -> bool:
    return bool(flags & C["CT_F_RST"]) or flags & _CLOSING == _CLOSING


def lifetime_ns(proto: int, flags: int) -> int:
    """How long a flow in this state lives after its last packet: ct.h ct_lifetime_ns()."""
    if proto == 6:
        if closing(flags):
            s = C["CT_TCP_CLOSE_S"]
        elif flags & C["CT_F_REPLIED"]:
            s = C["CT_TCP_EST_S"]
        else:
            s = C["CT_TCP_SYN_S"]
    else:
        s = C["CT_UDP_REPLIED_S"] if flags & C["CT_F_REPLIED"] else C["CT_UDP_S"]
    return s * NSEC


def rev_key(a_addr: int, a_port: int, b_addr: int, b_port: int, proto: int) -> CtKey:
    """The canonical REV key of the 4-tuple a <-> b (raw values): ct.h ct_rev_key()."""
    if (a_addr, a_port) > (b_addr, b_port):
        a_addr, a_port, b_addr, b_port = b_addr, b_port, a_addr, a_port
    return CtKey(saddr=a_addr, sport=a_port, daddr=b_addr, dport=b_port, proto=proto, dir=REV)


def fwd_key_of(e: CtEntry, proto: int) -> CtKey:
    return CtKey(saddr=e.client_addr, sport=e.client_port, daddr=e.front_addr, dport=e.front_port,
                 proto=proto, dir=FWD)


def rev_key_of(e: CtEntry, proto: int) -> CtKey:
    return rev_key(e.backend_addr, e.backend_port, e.src_addr, e.src_port, proto)


def peer_key(k: CtKey, e: CtEntry) -> CtKey:
    """The key of the flow's other entry."""
    return rev_key_of(e, k.proto) if k.dir == FWD else fwd_key_of(e, k.proto)


class Endpoint(NamedTuple):
    addr: str
    port: int

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"


def _ep(addr: int, port: int) -> Endpoint:
    return Endpoint(raw_to_ip(addr), raw_to_port(port))


@dataclass(frozen=True)
class Flow:
    """One tracked flow (from either of its entries)."""

    proto: int
    client: Endpoint     # as the client sent
    front: Endpoint      # the frontend it addressed
    backend: Endpoint
    source: Endpoint     # the source the backend sees (the client unless masqueraded/remapped)
    flags: int
    svc_id: int
    created_s: int
    last_ns: int
    fwd_key: CtKey
    rev_key: CtKey
    entries: int         # 2, or 1 when the other one is gone (evicted; the datapath restores it)

    @classmethod
    def of(cls, k: CtKey, e: CtEntry, entries: int = 2) -> "Flow":
        return cls(proto=k.proto, client=_ep(e.client_addr, e.client_port), front=_ep(e.front_addr, e.front_port),
                   backend=_ep(e.backend_addr, e.backend_port), source=_ep(e.src_addr, e.src_port),
                   flags=e.flags, svc_id=e.svc_id, created_s=e.created_s, last_ns=e.last_ns,
                   fwd_key=fwd_key_of(e, k.proto), rev_key=rev_key_of(e, k.proto), entries=entries)

    @property
    def expires_ns(self) -> int:
        return self.last_ns + lifetime_ns(self.proto, self.flags)

    def live(self, now: int | None = None) -> bool:
        return self.expires_ns > (now_ns() if now is None else now)

    @property
    def state(self) -> list[str]:
        return [name for bit, name in FLAG_NAMES.items() if self.flags & bit]

    @property
    def protocol(self) -> str:
        return PROTO_NAMES.get(self.proto, str(self.proto))


def _raw(k: CtKey) -> tuple:
    return (k.saddr, k.daddr, k.sport, k.dport, k.proto, k.dir)


def flows(maps: Maps) -> Iterator[Flow]:
    """Every tracked flow once (live or not), from a snapshot of ct_map. Both entries of
    a flow carry the same value; the newest refresh wins."""
    seen: dict[tuple, tuple[CtKey, CtEntry]] = {}
    keys = set()
    for k, e in maps.conntrack.items():
        keys.add(_raw(k))
        fk = _raw(fwd_key_of(e, k.proto))
        if fk not in seen or seen[fk][1].last_ns < e.last_ns:
            seen[fk] = (k, e)
    for fk, (k, e) in seen.items():
        both = fk in keys and _raw(rev_key_of(e, k.proto)) in keys
        yield Flow.of(k, e, 2 if both else 1)


def delete_flow(maps: Maps, flow: Flow) -> int:
    """Delete both entries of a flow; returns how many were there."""
    return maps.conntrack.delete(flow.fwd_key) + maps.conntrack.delete(flow.rev_key)


def get_flow(maps: Maps, k: CtKey) -> Flow | None:
    """The flow an entry key belongs to (either direction), or None."""
    e = maps.conntrack.get(k)
    if e is None:
        return None
    return Flow.of(k, e, 1 + (maps.conntrack.get(peer_key(k, e)) is not None))


__all__ = ["Flow", "Endpoint", "flows", "delete_flow", "get_flow", "rev_key", "fwd_key_of", "rev_key_of",
           "peer_key", "lifetime_ns", "now_ns", "FLAG_NAMES"]
