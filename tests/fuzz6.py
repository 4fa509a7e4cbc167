"""The IPv6 half of the datapath fuzzer (tests/fuzz.py is the IPv4 half and says how a
run goes): IPv6 services installed through ServiceTable, flows made by real frames,
then seeded rounds of mutated IPv6 frames through BPF_PROG_TEST_RUN on both hooks, each
output judged by an oracle that does not trust the program:

- a frame the datapath must not own (not IPv6 or malformed as parse6.h defines it, more
  extension headers than it walks, a routing header with segments left, AH, a later
  fragment whose first fragment was never translated, neighbour discovery and the other
  ICMPv6 control messages, no address of ours) comes out byte-identical;
- a frame that comes out changed has the same length, differs only in addresses,
  ports and checksums (outer, and inside an ICMPv6 error the quoted ones), every
  checksum valid going in is valid coming out (TCP/UDP/ICMPv6 over the IPv6
  pseudo-header, the quoted L4 checksum when the whole packet is quoted), nothing
  changes past the payload length, and no UDP checksum comes out 0 (IPv6 forbids it);
- a drop only for a frame addressed to a service address, and unchanged;
- a frame sent back is a well-formed ICMPv6 port unreachable from the address the
  client used, to the client, quoting its first 48 bytes;
- no other verdict.

The builders and the checker are the IPv4 half's (one's complement sums, Runner,
Meta/Failure bookkeeping); tests/test_fuzz6.py checks the IPv6 frames against scapy.
"""
from __future__ import annotations

import random
import socket
import struct
from dataclasses import dataclass

from fuzz import (BACKEND_PORT, CLIENT_MAC, NODE_MAC, NP_EMPTY, NP_TCP, NP_UDP, TCP, TCP_PORT, UDP, UDP_PORT,
                  VERDICTS, FuzzerBase, _be16, _put16, csum_compute, csum_valid, tcp, udp)
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.services import DatapathConfig, ServiceTable
from kxlb.loader.svcspec import Frontend, Kind, LbService

ICMP6 = 58
HOP, ROUTING, FRAG, AH, NONE, DSTOPTS = 0, 43, 44, 51, 59, 60
ERRORS6 = (1, 2, 3, 4)            # destination unreachable, packet too big, time exceeded, parameter problem
MAX_EXT, MAX_L4_OFF = 4, 256       # parse6.h IP6_MAX_EXT, IP6_MAX_L4_OFF


def ip6(text: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, text)


NODE6 = ip6("fd00:10:250::b")              # NodePorts and the masquerade address
CLUSTER_CIDR6 = "fd00:10::/32"              # pods: not masqueraded for a cluster IP
SERVICE_CIDR6 = "fd00:96::/112"
CIP6 = ip6("fd00:96::10")                  # TCP :80 and UDP :53, with NodePorts 30080/30053
EMPTY6 = ip6("fd00:96::20")                # without endpoints (NodePort 30081): rejected
UNALLOCATED6 = ip6("fd00:96::99")          # in the service CIDR, no Service: dropped
BACKENDS6 = (ip6("fd00:10:1::11"), ip6("fd00:10:2::11"), ip6("fd00:10:2::12"))
PODS6 = [ip6(f"fd00:10:{a}::{b:x}") for a in (3, 4) for b in range(2, 40)]
OUTSIDE6 = [ip6(f"2001:db8:{a}::{b:x}") for a in (1, 2) for b in range(2, 40)]
FOREIGN6 = [ip6("fd00:10:7::7"), ip6("2001:db8:99::8"), ip6("2606:4700::1111")]
OURS6 = {NODE6, CIP6, EMPTY6, UNALLOCATED6, *BACKENDS6}
SERVICE_ADDRS6 = {NODE6, CIP6, EMPTY6, UNALLOCATED6}


def in_service_cidr(a: bytes) -> bool:
    return a[:14] == CIP6[:14]


def install_services(table: ServiceTable) -> None:
    """The IPv6 services the fuzzer aims at, through the loader's own write path."""
    node = socket.inet_ntop(socket.AF_INET6, NODE6)
    table.set_config(DatapathConfig(snat_addrs=(node,), cluster_cidrs=(CLUSTER_CIDR6,), service_cidrs=(SERVICE_CIDR6,)))
    text = lambda a: socket.inet_ntop(socket.AF_INET6, a)  # noqa: E731
    backends = tuple(Backend(text(b), BACKEND_PORT) for b in BACKENDS6)
    for proto, port, np in ((TCP, TCP_PORT, NP_TCP), (UDP, UDP_PORT, NP_UDP)):
        table.put(LbService(key=ServiceKey(text(CIP6), port, proto), cluster=backends, has_endpoints=True,
                            frontends=(Frontend(ServiceKey(node, np, proto), Kind.NODE_PORT),),
                            name=f"fuzz6/web:{proto}"))
    for proto in (TCP, UDP):
        table.put(LbService(key=ServiceKey(text(EMPTY6), 80, proto), has_endpoints=False,
                            frontends=(Frontend(ServiceKey(node, NP_EMPTY, proto), Kind.NODE_PORT),),
                            name=f"fuzz6/empty:{proto}"))


# --- frames ---------------------------------------------------------------------------------
L4_CSUM_OFF6 = {TCP: 16, UDP: 6, ICMP6: 2}


def pseudo6(src: bytes, dst: bytes, proto: int, length: int) -> bytes:
    return src + dst + struct.pack("!IxxxB", length, proto)


def eth6(payload: bytes) -> bytearray:
    return bytearray(NODE_MAC + CLIENT_MAC + b"\x86\xdd" + payload)


def ipv6(src: bytes, dst: bytes, nh: int, payload: bytes, hlim: int = 64) -> bytes:
    """An IPv6 packet; ``payload`` starts with any extension headers (``nh`` names the first)."""
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload), nh, hlim, src, dst) + payload


def ext(nh: int, kind: int, body_units: int = 0, segleft: int = 0, rnd: random.Random | None = None) -> bytes:
    """One extension header of ``kind`` whose next header is ``nh``: hop-by-hop and
    destination options padded with PadN, a routing header (type 4) with ``segleft``,
    an atomic fragment header, AH (4 units)."""
    if kind == FRAG:
        return struct.pack("!BBHI", nh, 0, 0, rnd.randrange(1 << 32) if rnd else 7)
    if kind == AH:
        return struct.pack("!BBHII", nh, 4, 0, 0x100, 1) + bytes(12)   # (4 + 2) * 4 bytes
    n = 8 * (body_units + 1)
    if kind == ROUTING:
        return struct.pack("!BBBB", nh, body_units, 4, segleft) + bytes(n - 4)
    return struct.pack("!BBBB", nh, body_units, 1, n - 4) + bytes(n - 4)     # PadN over the rest


def walk(b, l3: int = 14) -> tuple[int, int, int, bool]:
    """(protocol, L4 offset, end, fragment) of the IPv6 packet at l3 as a receiver walks
    it; protocol -1 when the walk runs off the packet."""
    end = l3 + 40 + _be16(b, l3 + 4)
    nh, off, frag = b[l3 + 6], l3 + 40, False
    for _ in range(8):
        if nh == FRAG:
            if off + 8 > end:
                return -1, off, end, frag
            fo = _be16(b, off + 2)
            frag = frag or (fo & 0xFFF9) != 0
            nh, off = b[off], off + 8
            if fo & 0xFFF8:
                return nh, off, end, True
        elif nh in (HOP, ROUTING, DSTOPTS):
            if off + 8 > end:
                return -1, off, end, frag
            nh, off = b[off], off + (b[off + 1] + 1) * 8
        elif nh == AH:
            if off + 8 > end:
                return -1, off, end, frag
            nh, off = b[off], off + (b[off + 1] + 2) * 4
        else:
            break
    return nh, off, end, frag


def fix6(b: bytearray, l3: int = 14) -> bytearray:
    """The L4 checksum of an unfragmented IPv6 packet whose header is all there; for an
    ICMPv6 error quoting a whole unfragmented packet, the quoted L4 checksum first."""
    if len(b) < l3 + 40 or b[l3] >> 4 != 6 or l3 + 40 + _be16(b, l3 + 4) > len(b):
        return b
    proto, l4, end, frag = walk(b, l3)
    if frag or proto not in L4_CSUM_OFF6 or end - l4 < L4_CSUM_OFF6[proto] + 2:
        return b
    if proto == ICMP6 and b[l4] in ERRORS6 and end - l4 >= 48 and l4 + 8 + 40 + _be16(b, l4 + 12) <= end:
        fix6(b, l4 + 8)   # a whole quoted packet: its own checksum first
    c = l4 + L4_CSUM_OFF6[proto]
    _put16(b, c, 0)
    v = csum_compute(pseudo6(bytes(b[l3 + 8:l3 + 24]), bytes(b[l3 + 24:l3 + 40]), proto, end - l4), b[l4:end])
    if proto == UDP and v == 0:
        v = 0xFFFF
    _put16(b, c, v)
    return b


def icmp6(type_: int, code: int, body: bytes, rest: int = 0) -> bytes:
    return struct.pack("!BBHI", type_, code, 0, rest) + body


def packet6(src: bytes, dst: bytes, proto: int, l4: bytes, exts: bytes = b"", first: int | None = None) -> bytearray:
    """A whole Ethernet/IPv6 frame with right checksums (``exts``: extension headers,
    ``first`` the first one's type)."""
    return fix6(eth6(ipv6(src, dst, proto if first is None else first, exts + l4)))


# --- what the datapath must leave alone: parse6.h's contract, independently ----------------
@dataclass
class Parsed6:
    ok: bool                # parse6.h accepts it (else passed untouched)
    why: str = ""
    proto: int = 0
    l4: int = 0
    end: int = 0            # 14 + 40 + payload length
    frag: bool = False      # a fragment (an atomic fragment is whole)
    first: bool = True      # carries the L4 header
    ident: bytes = b""      # the fragment header's identification


def parse6(f) -> Parsed6:
    n = len(f)
    if n < 14 or bytes(f[12:14]) != b"\x86\xdd":
        return Parsed6(False, "not ipv6")
    if n < 54:
        return Parsed6(False, "ipv6 header cut")
    plen = _be16(f, 18)
    if f[14] >> 4 != 6:
        return Parsed6(False, "version")
    if plen == 0 or plen > n - 54:
        return Parsed6(False, "bad payload length")
    end = 54 + plen
    nh, off = f[20], 54
    p = Parsed6(True, "", end=end)
    for _ in range(MAX_EXT):
        if nh == FRAG:
            if off + 8 > n or off + 8 > end:
                return Parsed6(False, "fragment header cut")
            fo = _be16(f, off + 2)
            p.frag, p.first, p.ident = (fo & 0xFFF9) != 0, (fo & 0xFFF8) == 0, bytes(f[off + 4:off + 8])
            nh, off = f[off], off + 8
            if not p.first:
                p.proto, p.l4 = nh, off
                return p
            continue
        if nh not in (HOP, ROUTING, DSTOPTS):
            break
        if off + 4 > n or off + 4 > end:
            return Parsed6(False, "extension header cut")
        if nh == ROUTING and f[off + 3]:
            return Parsed6(False, "not ours: routing header with segments left")
        nh, off = f[off], off + (f[off + 1] + 1) * 8
        if off > MAX_L4_OFF:
            return Parsed6(False, "extension headers too long")
    if nh == AH:
        return Parsed6(False, "not ours: AH")
    if nh in (HOP, ROUTING, DSTOPTS, FRAG):
        return Parsed6(False, "more extension headers than walked")
    if off > MAX_L4_OFF:
        return Parsed6(False, "extension headers too long")
    p.proto, p.l4 = nh, off
    avail = end - off
    if nh == TCP:
        if avail < 20 or off + 20 > n:
            return Parsed6(False, "tcp header cut")
        doff = (f[off + 12] >> 4) * 4
        if doff < 20:
            return Parsed6(False, "tcp doff < 5")
        if doff > avail:
            return Parsed6(False, "tcp options cut")
    elif nh in (UDP, ICMP6) and avail < 8:
        return Parsed6(False, "l4 header cut")
    return p


def frag_key(f, p: Parsed6) -> bytes:
    return bytes(f[22:54]) + bytes((p.proto,)) + p.ident


def addresses6(f, p: Parsed6) -> tuple[bytes, ...]:
    out = (bytes(f[22:38]), bytes(f[38:54]))
    if p.proto == ICMP6 and p.first and p.end - p.l4 >= 48 and f[p.l4] in ERRORS6:
        q = p.l4 + 8
        out += (bytes(f[q + 8:q + 24]), bytes(f[q + 24:q + 40]))
    return out


def allowed6(f, p: Parsed6) -> set[int]:
    """Bytes a translation may change: addresses, ports, checksums (outer, and quoted
    inside an ICMPv6 error); all inside the payload length."""
    ok = set(range(22, 54))
    if p.first and p.proto in (TCP, UDP):
        ok.update(range(p.l4, p.l4 + 4))
        c = p.l4 + L4_CSUM_OFF6[p.proto]
        ok.update((c, c + 1))
    elif p.first and not p.frag and p.proto == ICMP6 and f[p.l4] in ERRORS6:
        ok.update((p.l4 + 2, p.l4 + 3))
        q = p.l4 + 8
        if q + 40 <= p.end:
            ok.update(range(q + 8, q + 40))
            qproto, ql4, _, _ = walk(f, q) if q + 40 + _be16(f, q + 4) <= len(f) else (f[q + 6], q + 40, 0, 0)
            ok.update(range(ql4, ql4 + 4))
            if qproto in (TCP, UDP):
                c = ql4 + L4_CSUM_OFF6[qproto]
                ok.update((c, c + 1))
    return {o for o in ok if o < p.end}


def checksums6(f, p: Parsed6) -> dict[str, bool]:
    """Every checksum that can be judged, valid or not; bounded by the payload length."""
    if p.frag or p.proto not in L4_CSUM_OFF6:
        return {}
    seg = f[p.l4:p.end]
    out = {"l4": csum_valid(pseudo6(bytes(f[22:38]), bytes(f[38:54]), p.proto, p.end - p.l4), seg)}
    if p.proto == ICMP6 and seg[0] in ERRORS6 and p.end - p.l4 >= 48:
        q = p.l4 + 8
        qend = q + 40 + _be16(f, q + 4)
        if qend <= p.end and f[q] >> 4 == 6:
            qproto, ql4, _, qfrag = walk(f, q)
            if qproto in (TCP, UDP) and not qfrag and ql4 + L4_CSUM_OFF6[qproto] + 2 <= qend:
                out["quoted l4"] = csum_valid(pseudo6(bytes(f[q + 8:q + 24]), bytes(f[q + 24:q + 40]), qproto,
                                                      qend - ql4), f[ql4:qend])
    if p.proto == UDP:
        c = p.l4 + 6
        out["udp nonzero"] = (f[c], f[c + 1]) != (0, 0)
    return out


def control_message(f, p: Parsed6) -> bool:
    """ICMPv6 neighbour discovery, MLD and every informational type above echo reply:
    link-local control traffic the datapath passes whatever it addresses (docs/datapath.md,
    IPv6). Echo request and reply to a cluster IP are rejected, as over IPv4."""
    return p.ok and p.first and p.proto == ICMP6 and f[p.l4] >= 130


def judge6(hook: str, f: bytes, verdict: int, out: bytes, translated: dict) -> tuple[str, list[str]]:
    kind = VERDICTS[hook].get(verdict)
    p = parse6(f)
    must_pass = None
    if not p.ok:
        must_pass = f"malformed or not ours ({p.why})"
    elif p.frag and not p.first and frag_key(f, p) not in translated:
        must_pass = "later fragment before its first"
    elif control_message(f, p):
        must_pass = f"ICMPv6 control message (type {f[p.l4]})"
    elif not any(a in OURS6 or in_service_cidr(a) for a in addresses6(f, p)):
        must_pass = "not ours"     # (an address of the service CIDR is ours: unallocated ones are dropped)
    if kind is None:
        return "bad verdict", [f"unexpected verdict {verdict:#x}"]
    if kind == "back":
        return "rejected", check_reject6(f, p, out, must_pass)
    if len(out) != len(f):
        return kind, [f"{kind}: frame length {len(f)} -> {len(out)}"]
    if kind == "drop":
        problems = []
        if must_pass:
            problems.append(f"dropped, but {must_pass}: must pass untouched")
        elif bytes(f[38:54]) not in SERVICE_ADDRS6 and not in_service_cidr(bytes(f[38:54])):
            problems.append("dropped a frame not addressed to a service address")
        if out != f:
            problems.append("dropped frame was modified")
        return "dropped", problems
    if out == f:
        return "untouched", []
    if must_pass:
        return "rewritten", [f"rewritten, but {must_pass}: must pass untouched"]
    problems = []
    ok = allowed6(f, p)
    bad = [i for i in range(len(f)) if f[i] != out[i] and i not in ok]
    if bad:
        where = "beyond the payload length" if min(bad) >= p.end else "outside addresses/ports/checksums"
        problems.append(f"bytes changed {where} at {bad[:8]}")
    before, after = checksums6(f, p), checksums6(out, p)
    for name, valid in before.items():
        if name == "udp nonzero":
            if not after.get(name, True):
                problems.append("UDP checksum written as 0 (IPv6 forbids it)")
        elif valid and not after.get(name, False):
            problems.append(f"{name} checksum invalid after the rewrite")
    return "rewritten", problems


def check_reject6(f, p: Parsed6, out: bytes, must_pass: str | None) -> list[str]:
    """kube-proxy's icmp6-port-unreachable: from the address the client used, to the
    client, back to its MAC, quoting the first 48 bytes of its packet."""
    problems = []
    if must_pass:
        problems.append(f"rejected, but {must_pass}: must pass untouched")
    if p.ok and p.frag:
        problems.append("rejected a fragment")
    if p.ok and p.proto == ICMP6 and f[p.l4] in ERRORS6:
        problems.append("answered an ICMPv6 error with an ICMPv6 error")
    if p.ok and not in_service_cidr(bytes(f[38:54])) and bytes(f[38:54]) != NODE6:
        problems.append("rejected a frame not addressed to a service")
    if len(out) != 14 + 40 + 8 + 48:
        return problems + [f"reject frame is {len(out)} bytes, expected 110"]
    if out[0:6] != f[6:12] or out[6:12] != f[0:6] or out[12:14] != b"\x86\xdd":
        problems.append("reject: Ethernet header not swapped back to the sender")
    if out[14] >> 4 != 6 or _be16(out, 18) != 56 or out[20] != ICMP6:
        problems.append("reject: bad IPv6 header")
    if out[22:38] != f[38:54] or out[38:54] != f[22:38]:
        problems.append("reject: not from the destination back to the source")
    if (out[54], out[55]) != (1, 4):
        problems.append(f"reject: ICMPv6 type/code {out[54]}/{out[55]}, expected 1/4")
    if not csum_valid(pseudo6(out[22:38], out[38:54], ICMP6, 56), out[54:110]):
        problems.append("reject: ICMPv6 checksum invalid")
    if out[62:110] != f[14:62]:
        problems.append("reject: quote is not the packet's first 48 bytes")
    return problems


# --- flows ----------------------------------------------------------------------------------
@dataclass
class Flow6:
    proto: int
    client: bytes
    cport: int
    front: bytes
    fport: int
    backend: bytes = b""
    src: bytes = b""
    sport: int = 0

    @property
    def masqueraded(self) -> bool:
        return self.src != self.client

    def l4(self, sport, dport, payload=b"", flags=0x18):
        return tcp(sport, dport, flags, 1000, 1, payload) if self.proto == TCP else udp(sport, dport, payload)

    def forward(self, payload=b"", flags=0x18, exts=b"", first=None) -> bytearray:
        return packet6(self.client, self.front, self.proto, self.l4(self.cport, self.fport, payload, flags), exts, first)

    def reply(self, payload=b"", flags=0x18) -> bytearray:
        return packet6(self.backend, self.src, self.proto, self.l4(BACKEND_PORT, self.sport, payload, flags))

    def at_backend(self, payload=b"") -> bytes:
        return bytes(packet6(self.src, self.backend, self.proto, self.l4(self.sport, BACKEND_PORT, payload)))[14:]

    def at_client(self, payload=b"") -> bytes:
        return bytes(packet6(self.front, self.client, self.proto, self.l4(self.fport, self.cport, payload)))[14:]


CATEGORIES = ("setup", "valid", "control messages", "truncate", "truncate+payload length", "payload length",
              "byte flips", "trailing bytes", "extension headers", "vlan", "icmpv6 error (tracked flow)",
              "icmpv6 error (masqueraded flow)", "icmpv6 error (bad quote)", "fragments in order",
              "fragments reversed", "fragments shuffled", "fragments without the first")


class Fuzzer6(FuzzerBase):
    """The IPv6 frames (fuzz.FuzzerBase does the bookkeeping and the sending)."""

    NAME = "IPv6"
    SRC, DST = slice(22, 38), slice(38, 54)
    LENGTH = (18, 54, 55, "truncate+payload length")   # the payload length counts after the fixed header
    FLIP_END = 110
    PODS, OUTSIDE, NODE, CIP, BACKENDS = PODS6, OUTSIDE6, NODE6, CIP6, BACKENDS6

    def __init__(self, table, runners, seed: int):
        super().__init__(table, runners, seed)
        self.translated: dict[bytes, bool] = {}

    @staticmethod
    def l4_offset(frame: bytes) -> int:
        return parse6(frame).l4

    def judge(self, hook, f, verdict, out):
        return judge6(hook, f, verdict, out, self.translated)

    def learn(self, f, outcome, out):
        p = parse6(f)
        if outcome == "rewritten" and p.ok and p.frag and p.first:
            self.translated[frag_key(f, p)] = True

    def fix(self, frame):
        return fix6(frame)

    def extra_frames(self):
        return self.control_frames()

    def valid_frames(self, flows: list[Flow6]) -> list[bytearray]:
        rnd, pl = self.rnd, self.payload
        pod, out, fl = rnd.choice(PODS6), rnd.choice(OUTSIDE6), rnd.choice(flows)
        return [
            fl.forward(pl()), fl.reply(pl()),
            packet6(pod, CIP6, TCP, tcp(self.port(), TCP_PORT, 0x02, payload=pl())),
            packet6(out, CIP6, UDP, udp(self.port(), UDP_PORT, pl())),
            packet6(out, NODE6, TCP, tcp(self.port(), NP_TCP, 0x02)),
            packet6(pod, NODE6, UDP, udp(self.port(), NP_UDP, pl())),
            packet6(pod, EMPTY6, TCP, tcp(self.port(), 80, 0x02)),                         # reject
            packet6(out, EMPTY6, UDP, udp(self.port(), 80, pl())),
            packet6(out, NODE6, TCP, tcp(self.port(), NP_EMPTY, 0x02)),
            packet6(pod, CIP6, TCP, tcp(self.port(), 81, 0x02)),                           # bad port
            packet6(pod, CIP6, ICMP6, icmp6(128, 0, pl(), 0x12340001)),                    # ping a cluster IP
            packet6(pod, UNALLOCATED6, UDP, udp(self.port(), 80, pl())),                   # drop
            packet6(rnd.choice(FOREIGN6), rnd.choice(FOREIGN6), TCP, tcp(self.port(), 80, payload=pl())),
            packet6(pod, rnd.choice(BACKENDS6), TCP, tcp(self.port(), BACKEND_PORT, 0x02)),
        ]

    def control_frames(self) -> list[tuple[bytearray, str]]:
        """Neighbour solicitation/advertisement, router solicitation, MLD, echo reply:
        addressed to the node, a cluster IP, a backend: all pass untouched."""
        rnd = self.rnd
        dst = rnd.choice((NODE6, CIP6, EMPTY6, rnd.choice(BACKENDS6), ip6("ff02::1:ff00:10")))
        type_ = rnd.choice((133, 134, 135, 136, 137, 130, 131, 143))
        return [(packet6(rnd.choice(PODS6), dst, ICMP6, icmp6(type_, 0, dst + self.payload(16))), "control messages")]

    def icmp_error(self, fl: Flow6, from_backend: bool, qlen: int | None = None) -> bytearray:
        rnd = self.rnd
        inner = fl.at_backend(self.payload(16)) if from_backend else fl.at_client(self.payload(16))
        if qlen is None:
            qlen = rnd.choice((48, 48, 60, len(inner), rnd.randrange(40, len(inner) + 1)))
        type_ = rnd.choice(ERRORS6)
        code = {1: rnd.choice((4, 0, 3)), 2: 0, 3: 0, 4: rnd.choice((0, 1))}[type_]
        rest = 1280 if type_ == 2 else 0
        body = icmp6(type_, code, inner[:qlen], rest)
        if from_backend:
            src = fl.backend if rnd.random() < .8 else rnd.choice(FOREIGN6)
            return packet6(src, fl.src, ICMP6, body)
        return packet6(fl.client, fl.front, ICMP6, body)

    # -- mutations
    def m_payload_length(self, frames):
        f = self.rnd.choice(frames)
        real = len(f) - 54
        out = []
        for v in sorted({0, 1, 7, 8, 19, 20, real - 1, real, real + 1, 0xFFFF, self.rnd.randrange(0x10000)}):
            if 0 <= v <= 0xFFFF:
                g = bytearray(f)
                _put16(g, 18, v)
                out.append((fix6(g) if self.rnd.random() < .7 else g, "payload length"))
        return out

    def m_ext(self, flows):
        """A flow's packet, or a new one, behind a chain of extension headers: options,
        a routing header (segments left or not), an atomic fragment header, AH."""
        rnd, fl = self.rnd, self.rnd.choice(flows)
        kinds = [rnd.choice((HOP, DSTOPTS, DSTOPTS, ROUTING, FRAG, AH)) for _ in range(rnd.randrange(1, 6))]
        if HOP in kinds:   # hop-by-hop only first, as senders put it
            kinds = [HOP] + [k for k in kinds if k != HOP]
        chain = b""
        nh = fl.proto
        for k in reversed(kinds):
            chain = ext(nh, k, rnd.randrange(3), rnd.choice((0, 0, 1)), rnd) + chain
            nh = k
        g = fl.forward(self.payload(), exts=chain, first=nh) if rnd.random() < .7 else \
            packet6(fl.client, fl.front, fl.proto, fl.l4(self.port(), fl.fport, b"", 0x02), chain, nh)
        return [(g, "extension headers")]

    def m_icmp(self, flows):
        fl, rnd = self.rnd.choice(flows), self.rnd
        g = self.icmp_error(fl, from_backend=rnd.random() < .6)
        cat = "icmpv6 error (masqueraded flow)" if fl.masqueraded else "icmpv6 error (tracked flow)"
        if rnd.random() < .15 and len(g) > 62 + 6:   # a quoted header that lies
            _put16(g, 62 + 4, rnd.randrange(0x10000))
            g = fix6(g)
            cat = "icmpv6 error (bad quote)"
        return [(g, cat)]

    def m_fragments(self, flows):
        rnd, fl = self.rnd, self.rnd.choice(flows)
        dg = bytes(fl.forward(rnd.randbytes(rnd.randrange(24, 160))) if rnd.random() < .6 else
                   fl.reply(rnd.randbytes(rnd.randrange(24, 160))))[14:]
        hdr, payload, proto = dg[:40], dg[40:], dg[6]
        n = len(payload)
        cuts = sorted(rnd.sample(range(8, n, 8), min(rnd.randrange(1, 4), len(range(8, n, 8)))))
        ident = rnd.randrange(1 << 32)
        bounds = [0] + cuts + [n]
        pieces = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            fh = struct.pack("!BBHI", proto, 0, a | (1 if i < len(bounds) - 2 else 0), ident)
            h = bytearray(hdr)
            h[6] = FRAG
            _put16(h, 4, 8 + b - a)
            pieces.append(eth6(bytes(h) + fh + payload[a:b]))
        order = rnd.randrange(4)
        if order == 1:
            pieces.reverse()
        elif order == 2:
            rnd.shuffle(pieces)
        elif order == 3:
            pieces = pieces[1:]
        cat = ("fragments in order", "fragments reversed", "fragments shuffled", "fragments without the first")[order]
        return [(p, cat) for p in pieces]


MUTATIONS = [(3, "m_truncate", "frames"), (2, "m_truncate_consistent", "frames"), (3, "m_payload_length", "frames"),
             (40, "m_flip", "frames"), (12, "m_trailing", "frames"), (6, "m_vlan", "frames"),
             (20, "m_ext", "flows"), (30, "m_icmp", "flows"), (12, "m_fragments", "flows")]


Fuzzer6.MUTATIONS, Fuzzer6.Flow = MUTATIONS, Flow6
