"""Conntrack as user space sees it: the one Python module that knows how ct_map holds a
flow (bpf/maps.h struct ct_entry, bpf/ct.h). The CLI lists flows with it, the controller
deletes stale UDP flows with it, tests read flows with it.

A flow has two entries with the same value: FWD keyed client -> frontend, REV keyed by
the translated 4-tuple backend <-> source in canonical order. Either entry rebuilds the
other's key; deleting a flow deletes both. IPv6 flows live in ct_map6 with the same
scheme (struct ct_key6/ct_entry6); every function here takes either family's structs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from .layout import (C, FAMILIES, PROTO_NAMES, V4, V6, CtEntry6, CtKey, CtKey6, Family, In6,
                     format_addr_port, raw_to_port)
from .maps import BpfMap, Maps

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


def _order(addr: int | In6):
    """An address field in ct.tmpl.h's KX_LT order: IPv4's one raw word, IPv6's four raw
    words one after the other (addr6.h kx6_lt)."""
    return addr if isinstance(addr, int) else tuple(addr.w)


def _family(obj) -> Family:
    return V6 if isinstance(obj, (CtKey6, CtEntry6, In6)) else V4


def _key_type(fam: Family) -> type:
    return CtKey6 if fam is V6 else CtKey


def rev_key(a_addr, a_port: int, b_addr, b_port: int, proto: int):
    """The canonical REV key of the 4-tuple a <-> b (raw values: u32 or struct kx_in6
    addresses, network-order ports): ct.tmpl.h ct_rev_key()."""
    if (_order(a_addr), a_port) > (_order(b_addr), b_port):
        a_addr, a_port, b_addr, b_port = b_addr, b_port, a_addr, a_port
    return _key_type(_family(a_addr))(saddr=a_addr, sport=a_port, daddr=b_addr, dport=b_port, proto=proto, dir=REV)


def fwd_key_of(e, proto: int):
    return _key_type(_family(e))(saddr=e.client_addr, sport=e.client_port, daddr=e.front_addr,
                                 dport=e.front_port, proto=proto, dir=FWD)


def rev_key_of(e, proto: int):
    return rev_key(e.backend_addr, e.backend_port, e.src_addr, e.src_port, proto)


def conntrack_map(maps: Maps, fam: Family) -> BpfMap:
    return fam.map(maps, "conntrack")


def peer_key(k, e):
    """The key of the flow's other entry."""
    return rev_key_of(e, k.proto) if k.dir == FWD else fwd_key_of(e, k.proto)


class Endpoint(NamedTuple):
    addr: str
    port: int

    def __str__(self) -> str:
        return format_addr_port(self.addr, self.port)


def _ep(addr, port: int) -> Endpoint:
    return Endpoint(_family(addr).c_addr(addr), raw_to_port(port))


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
    fwd_key: CtKey | CtKey6
    rev_key: CtKey | CtKey6
    entries: int         # 2, or 1 when the other one is gone (evicted; the datapath restores it)

    @classmethod
    def of(cls, k, e, entries: int = 2) -> "Flow":
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

    @property
    def family(self) -> Family:
        return _family(self.fwd_key)


def flows(maps: Maps, families: tuple[Family, ...] = FAMILIES) -> Iterator[Flow]:
    """Every tracked flow once (live or not), from a snapshot of ct_map (and ct_map6).
    Both entries of a flow carry the same value; the newest refresh wins."""
    for fam in families:
        seen: dict[bytes, tuple] = {}
        keys = set()
        for k, e in conntrack_map(maps, fam).items():
            keys.add(bytes(k))
            fk = bytes(fwd_key_of(e, k.proto))
            if fk not in seen or seen[fk][1].last_ns < e.last_ns:
                seen[fk] = (k, e)
        for fk, (k, e) in seen.items():
            both = fk in keys and bytes(rev_key_of(e, k.proto)) in keys
            yield Flow.of(k, e, 2 if both else 1)


def delete_flow(maps: Maps, flow: Flow) -> int:
    """Delete both entries of a flow; returns how many were there."""
    ct = conntrack_map(maps, flow.family)
    return ct.delete(flow.fwd_key) + ct.delete(flow.rev_key)


def get_flow(maps: Maps, k) -> Flow | None:
    """The flow an entry key (either family, either direction) belongs to, or None."""
    ct = conntrack_map(maps, _family(k))
    e = ct.get(k)
    if e is None:
        return None
    return Flow.of(k, e, 1 + (ct.get(peer_key(k, e)) is not None))


__all__ = ["Flow", "Endpoint", "flows", "delete_flow", "get_flow", "rev_key", "fwd_key_of", "rev_key_of",
           "peer_key", "lifetime_ns", "now_ns", "FLAG_NAMES"]
