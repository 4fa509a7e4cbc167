"""Conntrack as user space sees it: the one Python module that knows how ct_map holds a
flow (bpf/maps.h struct ct_entry, bpf/ct.h, bpf/ct.tmpl.h). The CLI lists flows with it,
the controller deletes stale UDP flows with it, tests read flows with it.

A record per client socket (address, port, protocol) holds up to KXLB_CT_WAYS flows, one
per frontend the socket reaches; a flow's `claim` word holds its frontend and its state.
A masqueraded or remapped flow also holds a way of one port of the masquerade port table
(masq_map): deleting the flow frees that way too. IPv6 flows live in ct_map6 and
masq_map6 with the same layout (16-byte addresses); every function here takes either
family.
"""
from __future__ import annotations

import ctypes
import struct
import time
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from .layout import C, FAMILIES, PROTO_NAMES, V6, Family, format_addr_port, raw_to_port
from .maps import BpfMap, Maps

CLOCK = 6  # CLOCK_MONOTONIC_COARSE (Linux): the datapath's bpf_ktime_get_coarse_ns()
TICK_SHIFT = C["TICK_SHIFT"]
FWD, REV = C["CT_DIR_FWD"], C["CT_DIR_REV"]
F = {name.removeprefix("CT_F_"): v for name, v in C.items() if name.startswith("CT_F_")}
_CLOSING = F["FIN_FWD"] | F["FIN_REV"]
_MOVED = F["SNAT"] | F["REMAP"] | F["DIRECT"]

FLAG_NAMES = {F["REPLIED"]: "replied", F["FIN_FWD"]: "fin-client", F["FIN_REV"]: "fin-backend", F["RST"]: "rst",
              F["SNAT"]: "masqueraded", F["REMAP"]: "port-remapped", F["DIRECT"]: "direct-remapped",
              F["FWD_ACK"]: "fwd-ack", F["REV_ACK"]: "rev-ack"}


def ticks(seconds: int) -> int:
    """consts.h KXLB_TICKS(): seconds in ticks of 2^30 ns, rounded up."""
    return (seconds * 1_000_000_000 + (1 << TICK_SHIFT) - 1) >> TICK_SHIFT


def now_ticks() -> int:
    """The datapath's clock, in its ticks."""
    return (time.clock_gettime_ns(CLOCK) >> TICK_SHIFT) & 0xffffffff


def closing(flags: int) -> bool:
    return bool(flags & F["RST"]) or flags & _CLOSING == _CLOSING


def confirmed(proto: int, flags: int) -> bool:
    """ct.h ct_confirmed(): a packet without SYN each way (TCP), answered and spoken to
    again (UDP)."""
    want = F["FWD_ACK"] | F["REV_ACK"] if proto == 6 else F["REPLIED"] | F["FWD_ACK"]
    return flags & want == want


def lifetime(proto: int, flags: int) -> int:
    """ct.h ct_lifetime(): how many ticks a flow in this state lives after its last packet."""
    if proto == 6:
        if closing(flags):
            return ticks(C["CT_TCP_CLOSE_S"])
        return ticks(C["CT_TCP_EST_S"] if confirmed(proto, flags) else C["CT_TCP_SYN_S"])
    return ticks(C["CT_UDP_REPLIED_S"] if flags & F["REPLIED"] else C["CT_UDP_S"])


def masq_hold(proto: int, flags: int) -> int:
    """ct.h masq_hold(): a masquerade port stays taken this long after its flow's last packet."""
    return lifetime(proto, flags) + (ticks(C["CT_TCP_TIME_WAIT_S"]) if proto == 6 else 0)


def _rol32(w: int, s: int) -> int:
    return ((w << s) | (w >> (32 - s))) & 0xffffffff


def _fold6(w) -> int:
    return (w[0] ^ w[1] ^ _rol32(w[2], 7) ^ _rol32(w[3], 13)) & 0xffffffff


def fold(fam: Family, addr) -> int:
    """family.tmpl.h KX_FOLD() (addr6.h kx6_fold for IPv6): an address field's value as
    the 32 bits a claim or an address filter uses."""
    return _fold6(addr.w) if fam is V6 else addr


_WORDS6 = struct.Struct("<4I")


def fold_packed(fam: Family, raw: bytes) -> int:
    """fold() of a packed address (network order, as inet_pton gives it), without a
    ctypes object: a full sync folds every backend of the node."""
    return _fold6(_WORDS6.unpack(raw)) if fam is V6 else int.from_bytes(raw, "little")


def ct_claim(fam: Family, front, front_port: int, flags: int) -> int:
    """ct.tmpl.h ct_claim() (front_port: the raw, network-order field)."""
    return (fold(fam, front) << 32) | (front_port << 16) | flags


def masq_claim(fam: Family, peer, peer_port: int, proto: int, flags: int) -> int:
    return (fold(fam, peer) << 32) | (peer_port << 16) | (proto << 8) | flags


def masq_way_index(fam: Family, peer, peer_port: int) -> int:
    """ct.tmpl.h masq_way_index(): the way of a masquerade port a backend may hold."""
    h = (fold(fam, peer) ^ ((peer_port << 16) & 0xffffffff)) & 0xffffffff
    h ^= h >> 16
    h = (h * 0x45d9f3b) & 0xffffffff
    return (h >> 16) % C["MASQ_WAYS"]


def conntrack_map(maps: Maps, fam: Family) -> BpfMap:
    return fam.map(maps, "conntrack")


def masq_map(maps: Maps, fam: Family) -> BpfMap:
    return fam.map(maps, "masq_ports")


class Endpoint(NamedTuple):
    addr: str
    port: int

    def __str__(self) -> str:
        return format_addr_port(self.addr, self.port)


@dataclass(frozen=True)
class Flow:
    """One tracked flow: a way of its client socket's record."""

    family: Family
    proto: int
    client: Endpoint     # as the client sent
    front: Endpoint      # the frontend it addressed
    backend: Endpoint
    source_port: int     # the port the backend sees (the client's unless masqueraded/remapped)
    flags: int
    svc_id: int
    last: int            # tick of its last packet
    key: object          # its record's key (struct ct_key or ct_key6)
    way: int             # its way in the record

    @property
    def expires(self) -> int:
        return (self.last + lifetime(self.proto, self.flags)) & 0xffffffff

    def live(self, now: int | None = None) -> bool:
        now = now_ticks() if now is None else now
        return bool(self.flags & F["USED"]) and (now - self.last) & 0xffffffff < lifetime(self.proto, self.flags)

    def expires_in_s(self, now: int | None = None) -> float:
        now = now_ticks() if now is None else now
        left = lifetime(self.proto, self.flags) - ((now - self.last) & 0xffffffff)
        return left * (1 << TICK_SHIFT) / 1e9

    @property
    def masqueraded(self) -> bool:
        return bool(self.flags & F["SNAT"])

    @property
    def moved(self) -> bool:
        """It has a port of the masquerade table (masqueraded or remapped)."""
        return bool(self.flags & _MOVED)

    @property
    def state(self) -> list[str]:
        return [name for bit, name in FLAG_NAMES.items() if self.flags & bit]

    @property
    def protocol(self) -> str:
        return PROTO_NAMES.get(self.proto, str(self.proto))


def _flows_of(fam: Family, k, rec) -> Iterator[Flow]:
    for i, f in enumerate(rec.flow):
        if not f.claim & F["USED"]:
            continue
        yield Flow(family=fam, proto=k.proto, client=Endpoint(fam.c_addr(k.addr), raw_to_port(k.port)),
                   front=Endpoint(fam.c_addr(f.front_addr), raw_to_port((f.claim >> 16) & 0xffff)),
                   backend=Endpoint(fam.c_addr(f.backend_addr), raw_to_port(f.backend_port)),
                   source_port=raw_to_port(f.src_port), flags=f.claim & 0xffff, svc_id=f.svc_id, last=f.last,
                   key=fam.struct("ct_key").from_buffer_copy(k), way=i)


def flows(maps: Maps, families: tuple[Family, ...] = FAMILIES) -> Iterator[Flow]:
    """Every tracked flow (live or not) in a snapshot of ct_map (and ct_map6)."""
    for fam in families:
        for k, rec in conntrack_map(maps, fam).items():
            yield from _flows_of(fam, k, rec)


def get_flows(maps: Maps, fam: Family, addr: str, port: int, proto: int) -> list[Flow]:
    """The flows of one client socket."""
    from .layout import port_to_raw

    k = fam.struct("ct_key")(addr=fam.addr_c(addr), port=port_to_raw(port), proto=proto)
    rec = conntrack_map(maps, fam).get(k)
    return list(_flows_of(fam, k, rec)) if rec is not None else []


def delete_flow(maps: Maps, flow: Flow) -> bool:
    """Free a flow's way in its record, and its masquerade port (the way of that port held
    for its backend). The record goes when its last way does. A datapath write to another
    way of the same record at this moment may be lost (user space writes a record whole):
    that flow's next packet creates it again."""
    ct = conntrack_map(maps, flow.family)
    rec = ct.get(flow.key)
    if rec is None or not rec.flow[flow.way].claim & F["USED"]:
        return False
    f = rec.flow[flow.way]
    backend, backend_port, src_port = f.backend_addr, f.backend_port, f.src_port
    ctypes.memset(ctypes.addressof(f), 0, ctypes.sizeof(f))
    if any(w.claim & F["USED"] for w in rec.flow):
        ct.put(flow.key, rec)
    else:
        ct.delete(flow.key)
    if flow.moved:
        _free_port(maps, flow.family, raw_to_port(src_port), backend, backend_port, flow.proto)
    return True


class MasqUsage(NamedTuple):
    """How full a family's masquerade port table is, within the range in use."""
    first: int
    last: int
    ports_used: int   # ports with at least one live way
    ways_used: int    # live ways: flows (or TIME_WAIT holds) that own a port

    @property
    def ports(self) -> int:
        return self.last - self.first + 1


def masq_usage(maps: Maps, fam: Family, first: int, last: int, now: int | None = None) -> MasqUsage:
    """Count the live ways of ports first..last (one batched read of the array)."""
    now = now_ticks() if now is None else now
    way_t = fam.struct("masq_way")
    size, ways = ctypes.sizeof(way_t), C["MASQ_WAYS"]
    claim_at, expires_at = way_t.claim.offset, way_t.expires.offset
    keys, values, n = masq_map(maps, fam).items_raw()
    idx = memoryview(keys).cast("I")
    vals = memoryview(values)
    used_flag = C["MASQ_F_USED"]
    ports = flows = 0
    for i in range(n):
        if not first <= idx[i] <= last:
            continue
        live = 0
        for w in range(ways):
            at = (i * ways + w) * size
            claim = int.from_bytes(vals[at + claim_at:at + claim_at + 8], "little")
            expires = int.from_bytes(vals[at + expires_at:at + expires_at + 4], "little")
            if claim & used_flag and 0 < (expires - now) & 0xffffffff < 1 << 31:
                live += 1
        ports += live > 0
        flows += live
    return MasqUsage(first, last, ports, flows)


def _free_port(maps: Maps, fam: Family, port: int, peer, peer_port: int, proto: int) -> None:
    """Expire the way of masquerade port `port` held for backend peer:peer_port."""
    m = masq_map(maps, fam)
    e = m.get(ctypes.c_uint32(port))
    if e is None:
        return
    w = e.way[masq_way_index(fam, peer, peer_port)]
    if w.claim & ~0xff == masq_claim(fam, peer, peer_port, proto, 0):
        w.expires = now_ticks()
        m.put(ctypes.c_uint32(port), e)


__all__ = ["Flow", "Endpoint", "MasqUsage", "masq_usage", "flows", "get_flows", "delete_flow", "lifetime", "now_ticks", "FLAG_NAMES"]
