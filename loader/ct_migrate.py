"""Conntrack between its layouts: 1 (kxlb 0.1: two entries per flow, one per direction)
and 2 (one record per client socket, and the masquerade port table), both ways: up for a
load of this release over an older datapath, down for `kxlb downgrade`.

Layout 1's structs are declared here, as released (they are history, and must not follow
maps.h); layout 2's are maps.h's. What does not carry over is counted and reported: a
record holds KXLB_CT_WAYS flows of a socket, a masquerade port one flow per backend way,
and layout 1 has no direct-traffic remaps (their traffic goes on untranslated).
"""
from __future__ import annotations

import ctypes
import socket
from typing import Iterable

from . import conntrack as ct
from .layout import V4, V6, C, Family, In6, family_of
from .migrate import SELF, Entry, Targets, converter

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class CtKeyV1(ctypes.Structure):
    _fields_ = [("saddr", u32), ("daddr", u32), ("sport", u16), ("dport", u16), ("proto", u8), ("dir", u8),
                ("pad", u16)]


class CtEntryV1(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("flags", u64), ("client_addr", u32), ("front_addr", u32), ("backend_addr", u32),
                ("src_addr", u32), ("client_port", u16), ("front_port", u16), ("backend_port", u16),
                ("src_port", u16), ("svc_id", u32), ("created_s", u32)]


class CtKey6V1(ctypes.Structure):
    _fields_ = [("saddr", In6), ("daddr", In6), ("sport", u16), ("dport", u16), ("proto", u8), ("dir", u8),
                ("pad", u16)]


class CtEntry6V1(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("flags", u64), ("client_addr", In6), ("front_addr", In6), ("backend_addr", In6),
                ("src_addr", In6), ("client_port", u16), ("front_port", u16), ("backend_port", u16),
                ("src_port", u16), ("svc_id", u32), ("created_s", u32)]


V1 = {V4: (CtKeyV1, CtEntryV1), V6: (CtKey6V1, CtEntry6V1)}
FWD_V1, REV_V1 = 0, 1
FLAGS_V1 = {"REPLIED": 0x01, "FIN_FWD": 0x02, "FIN_REV": 0x04, "RST": 0x08, "SNAT": 0x10, "REMAP": 0x20}
F = ct.F
TICK = C["TICK_SHIFT"]


def _flags_up(v1: int, proto: int) -> int:
    out = F["USED"]
    for name, bit in FLAGS_V1.items():
        if v1 & bit:
            out |= F[name]
    if v1 & FLAGS_V1["REPLIED"]:   # layout 1 called a replied flow established: keep it so
        out |= F["FWD_ACK"] | (F["REV_ACK"] if proto == socket.IPPROTO_TCP else 0)
    return out


def _flags_down(v2: int) -> int:
    return sum(bit for name, bit in FLAGS_V1.items() if v2 & F[name])


def _order(fam: Family, addr) -> tuple:
    return tuple(addr.w) if fam is V6 else (addr,)


def up(fam: Family):
    """Layout 1 -> 2 for one family."""
    key_v1, entry_v1 = V1[fam]
    key_t, rec_t = fam.struct("ct_key"), fam.struct("ct_entry")
    masq_t = fam.struct("masq_entry")
    masq = "masq_ports" + fam.suffix

    def step(entries: Iterable[Entry], out: Targets) -> None:
        flows: dict[tuple, ctypes.Structure] = {}   # (client, front, backend) -> the newest entry
        for kb, vb in entries:
            e = entry_v1.from_buffer_copy(vb)
            k = key_v1.from_buffer_copy(kb)
            ident = (bytes(e.client_addr) if fam is V6 else e.client_addr, e.client_port, k.proto,
                     bytes(e.front_addr) if fam is V6 else e.front_addr, e.front_port)
            if ident not in flows or flows[ident][1].last_ns < e.last_ns:
                flows[ident] = (k.proto, e)
        records: dict[bytes, ctypes.Structure] = {}
        ports: dict[int, ctypes.Structure] = {}
        for (_, _, proto, _, _), (_, e) in flows.items():
            key = bytes(key_t(addr=e.client_addr, port=e.client_port, proto=proto))
            rec = records.setdefault(key, rec_t())
            way = next((w for w in rec.flow if not w.claim), None)
            if way is None:
                out.drop()   # more flows of one socket than a record holds
                continue
            flags = _flags_up(e.flags, proto)
            last = (e.last_ns >> TICK) & 0xffffffff
            way.claim = ct.ct_claim(fam, e.front_addr, e.front_port, flags)
            way.front_addr, way.backend_addr, way.backend_port = e.front_addr, e.backend_addr, e.backend_port
            way.src_port, way.last, way.svc_id = e.src_port, last, e.svc_id
            if flags & (F["SNAT"] | F["REMAP"]):
                port = socket.ntohs(e.src_port)
                entry = ports.setdefault(port, masq_t())
                w = entry.way[ct.masq_way_index(fam, e.backend_addr, e.backend_port)]
                if w.claim:
                    out.drop()   # two flows to one backend on one port's way: layout 2 holds one
                    ctypes.memset(ctypes.addressof(way), 0, ctypes.sizeof(way))
                    continue
                confirmed = C["MASQ_F_CONFIRMED"] if ct.confirmed(proto, flags) else 0
                w.claim = ct.masq_claim(fam, e.backend_addr, e.backend_port, proto, C["MASQ_F_USED"] | confirmed)
                w.peer_addr, w.client_addr, w.client_port = e.backend_addr, e.client_addr, e.client_port
                w.born, w.expires = last, (last + ct.masq_hold(proto, flags)) & 0xffffffff
        for key, rec in records.items():
            if any(w.claim for w in rec.flow):
                out.put(SELF, key, bytes(rec))
        for port, entry in ports.items():
            out.put(masq, port.to_bytes(4, "little"), bytes(entry), merge=_merge_ways(masq_t))
    return step


def _merge_ways(masq_t):
    """A converted masquerade entry into one the new datapath wrote meanwhile: its ways
    are kept, the converted ones fill the free ways."""
    def merge(current: bytes, new: bytes) -> bytes:
        cur, add = masq_t.from_buffer_copy(current), masq_t.from_buffer_copy(new)
        for i, w in enumerate(add.way):
            if w.claim and not cur.way[i].claim:
                cur.way[i] = w
        return bytes(cur)
    return merge


def down(fam: Family, snat: str | None):
    """Layout 2 -> 1 for one family: each flow as its two entries (the masquerade address
    of the node, `snat`, for masqueraded ones). Direct-traffic remaps have no layout 1."""
    key_v1, entry_v1 = V1[fam]
    key_t, rec_t = fam.struct("ct_key"), fam.struct("ct_entry")
    snat_c = fam.addr_c(snat) if snat else None

    def step(entries: Iterable[Entry], out: Targets) -> None:
        for kb, vb in entries:
            k, rec = key_t.from_buffer_copy(kb), rec_t.from_buffer_copy(vb)
            for w in rec.flow:
                flags = w.claim & 0xffff
                if not flags & F["USED"]:
                    continue
                if flags & F["DIRECT"] or (flags & F["SNAT"] and snat_c is None):
                    out.drop()
                    continue
                src = snat_c if flags & F["SNAT"] else k.addr
                e = entry_v1(last_ns=w.last << TICK, flags=_flags_down(flags), client_addr=k.addr,
                             front_addr=w.front_addr, backend_addr=w.backend_addr, src_addr=src,
                             client_port=k.port, front_port=(w.claim >> 16) & 0xffff, backend_port=w.backend_port,
                             src_port=w.src_port, svc_id=w.svc_id, created_s=(w.last << TICK) // 1_000_000_000)
                fwd = key_v1(saddr=k.addr, daddr=w.front_addr, sport=k.port, dport=e.front_port, proto=k.proto,
                             dir=FWD_V1)
                a, b = (w.backend_addr, w.backend_port), (src, w.src_port)
                if (_order(fam, a[0]), a[1]) > (_order(fam, b[0]), b[1]):
                    a, b = b, a
                rev = key_v1(saddr=a[0], sport=a[1], daddr=b[0], dport=b[1], proto=k.proto, dir=REV_V1)
                out.put(SELF, bytes(fwd), bytes(e))
                out.put(SELF, bytes(rev), bytes(e))
    return step


converter("conntrack", 1, 2)(up(V4))
converter("conntrack6", 1, 2)(up(V6))


def downgrade_converters(snat_addrs: tuple[str, ...]) -> dict[tuple[str, int, int], object]:
    """The steps down, which need the node's masquerade addresses (layout 1 keeps the
    source a backend sees in every entry; layout 2 takes it from lb_config)."""
    snat = {family_of(a): a for a in snat_addrs}
    return {("conntrack", 2, 1): down(V4, snat.get(V4)), ("conntrack6", 2, 1): down(V6, snat.get(V6))}
