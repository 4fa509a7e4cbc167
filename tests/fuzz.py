"""A BPF_PROG_TEST_RUN fuzzer for the datapath (tc and XDP), used by tests/test_fuzz.py
and `make fuzz`.

Services are installed through ServiceTable (a cluster IP with a NodePort, TCP and UDP,
masquerade and a service CIDR configured, a service without endpoints), and tracked and
masqueraded flows are made by running real SYN/UDP frames through the program (never by
writing conntrack). Then seeded rounds of mutated frames go through the program, one
BPF_PROG_TEST_RUN each, and every output is judged by an oracle that does not trust the
program:

- a frame the datapath must not own (not IPv4, a VLAN tag, malformed as parse.h defines
  it, a later fragment whose first fragment was never translated, no address of ours)
  comes out byte-identical with the pass verdict;
- a frame that comes out changed has the same length, differs only in the fields a
  translation may touch (addresses, ports, checksums; inside an ICMP error, the quoted
  ones), and every checksum that was valid going in is valid coming out (IPv4 header,
  TCP/UDP/ICMP, the quoted IP header, the quoted L4 checksum when the whole packet is
  quoted), bounded by the IP total length, never the frame's end;
- a drop only for a frame addressed to a service address, and unchanged;
- a frame sent back is a well-formed ICMP port unreachable, from the address the
  client used, to the client, quoting its packet; nothing else grows or shrinks;
- no other verdict.

Frames are built here with struct (a template's checksums by the same fast checker that
judges the outputs; tests/test_fuzz.py checks both against scapy), because scapy in the
loop would cost milliseconds a frame.
"""
from __future__ import annotations

import ctypes
import random
import socket
import struct
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from kxlb.loader import bpfsys
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.services import DatapathConfig, ServiceTable
from kxlb.loader.svcspec import Frontend, Kind, LbService

# --- verdicts ------------------------------------------------------------------------------
# Pass at tc is TC_ACT_OK (0) or TC_ACT_UNSPEC (-1, "continue with the next filter", issue
# 8 item 6): both are accepted, for frames the program rewrote and for those it did not.
TC_OK, TC_SHOT, TC_REDIRECT, TC_UNSPEC = 0, 2, 7, 0xFFFFFFFF
XDP_DROP, XDP_PASS, XDP_TX = 1, 2, 3
VERDICTS = {
    "tc": {TC_OK: "pass", TC_UNSPEC: "pass", TC_SHOT: "drop", TC_REDIRECT: "back"},
    "xdp": {XDP_PASS: "pass", XDP_DROP: "drop", XDP_TX: "back"},
}

# --- the cluster -----------------------------------------------------------------------------
def ip(text: str) -> bytes:
    return socket.inet_aton(text)


NODE_MAC, CLIENT_MAC = bytes.fromhex("020000000002"), bytes.fromhex("020000000001")
NODE_IP = ip("10.250.0.11")            # NodePorts and the masquerade address
CLUSTER_CIDR = "10.0.0.0/16"           # pods: not masqueraded for a cluster IP
SERVICE_CIDR = "10.96.0.0/16"
CIP = ip("10.96.0.10")                 # TCP :80 and UDP :53, with NodePorts 30080/30053
EMPTY = ip("10.96.0.20")               # TCP/UDP :80 without endpoints (NodePort 30081): rejected
UNALLOCATED = ip("10.96.0.99")         # in the service CIDR, no Service: dropped
BACKENDS = (ip("10.0.1.11"), ip("10.0.2.11"), ip("10.0.2.12"))
BACKEND_PORT = 8080
TCP_PORT, UDP_PORT, NP_TCP, NP_UDP, NP_EMPTY = 80, 53, 30080, 30053, 30081
PODS = [ip(f"10.0.{a}.{b}") for a in (3, 4) for b in range(2, 40)]
OUTSIDE = [ip(f"192.0.2.{b}") for b in range(2, 60)] + [ip(f"203.0.113.{b}") for b in range(2, 30)]
FOREIGN = [ip("10.0.7.7"), ip("10.0.8.8"), ip("8.8.8.8"), ip("172.16.0.5")]

# Addresses the datapath may act on (outer or quoted): anything else is not ours.
OURS = {NODE_IP, *BACKENDS} | {ip(f"10.96.{a}.{b}") for a in range(256) for b in range(256)}
# A drop or a reject only for frames addressed to a service address.
SERVICE_ADDRS = {NODE_IP} | {a for a in OURS if a[:2] == b"\x0a\x60"}

TCP, UDP, ICMP = 6, 17, 1
ICMP_ERRORS = (3, 11, 12)


def install_services(table: ServiceTable) -> None:
    """The services the fuzzer aims at, through the loader's own write path."""
    table.set_config(DatapathConfig(snat_addrs=(socket.inet_ntoa(NODE_IP),), cluster_cidrs=(CLUSTER_CIDR,),
                                    service_cidrs=(SERVICE_CIDR,)))
    backends = tuple(Backend(socket.inet_ntoa(b), BACKEND_PORT) for b in BACKENDS)
    cip, empty, node = socket.inet_ntoa(CIP), socket.inet_ntoa(EMPTY), socket.inet_ntoa(NODE_IP)
    for proto, port, np in ((TCP, TCP_PORT, NP_TCP), (UDP, UDP_PORT, NP_UDP)):
        table.put(LbService(key=ServiceKey(cip, port, proto), cluster=backends, has_endpoints=True,
                            frontends=(Frontend(ServiceKey(node, np, proto), Kind.NODE_PORT),),
                            name=f"fuzz/web:{proto}"))
    for proto in (TCP, UDP):
        table.put(LbService(key=ServiceKey(empty, 80, proto), has_endpoints=False,
                            frontends=(Frontend(ServiceKey(node, NP_EMPTY, proto), Kind.NODE_PORT),),
                            name=f"fuzz/empty:{proto}"))


# --- checksums: one's complement sums as big integers --------------------------------------
# 2**16 = 1 (mod 0xffff), so the one's complement sum of 16-bit words is the value of the
# byte string, read as one big-endian integer, modulo 0xffff (0 standing for 0xffff unless
# every byte is zero). One int.from_bytes per check instead of a Python loop over words.
def _value(b) -> int:
    return int.from_bytes(b, "big") << (8 if len(b) & 1 else 0)


def csum_valid(*parts) -> bool:
    """Do the parts (every one but the last of even length) sum to negative zero?"""
    total = sum(_value(p) for p in parts)
    return total != 0 and total % 0xFFFF == 0


def csum_compute(*parts) -> int:
    """The checksum to store in a zeroed field of the parts."""
    total = sum(_value(p) for p in parts)
    s = total % 0xFFFF
    if s == 0 and total:
        s = 0xFFFF
    return 0xFFFF - s


def pseudo(src: bytes, dst: bytes, proto: int, length: int) -> bytes:
    return src + dst + bytes((0, proto)) + (length & 0xFFFF).to_bytes(2, "big")


def _be16(b, off: int) -> int:
    return (b[off] << 8) | b[off + 1]


def _put16(b: bytearray, off: int, v: int) -> None:
    b[off] = v >> 8
    b[off + 1] = v & 0xFF


L4_CSUM_OFF = {TCP: 16, UDP: 6, ICMP: 2}


def fix_l4(b: bytearray, l3: int, keep_zero_udp: bool = True) -> None:
    """Recompute the L4 checksum of the (unfragmented) IPv4 packet at l3, over its total
    length; a zero UDP checksum ("none") stays zero when keep_zero_udp."""
    hl, tot, proto = (b[l3] & 15) * 4, _be16(b, l3 + 2), b[l3 + 9]
    l4, end = l3 + hl, l3 + tot
    if proto not in L4_CSUM_OFF or end > len(b) or end - l4 < L4_CSUM_OFF[proto] + 2:
        return
    c = l4 + L4_CSUM_OFF[proto]
    if proto == UDP and keep_zero_udp and b[c] == 0 and b[c + 1] == 0:
        return
    _put16(b, c, 0)
    if proto == ICMP:
        v = csum_compute(b[l4:end])
    else:
        v = csum_compute(pseudo(b[l3 + 12:l3 + 16], b[l3 + 16:l3 + 20], proto, end - l4), b[l4:end])
        if proto == UDP and v == 0:
            v = 0xFFFF
    _put16(b, c, v)


def fix_ip(b: bytearray, l3: int) -> None:
    hl = (b[l3] & 15) * 4
    if hl >= 20 and l3 + hl <= len(b):
        _put16(b, l3 + 10, 0)
        _put16(b, l3 + 10, csum_compute(b[l3:l3 + hl]))


def fix(b: bytearray, l3: int = 14) -> bytearray:
    """Make the checksums of a frame right, as its sender would have: the IP header; the
    L4 checksum of an unfragmented packet whose header is all there; for an ICMP error,
    first the quoted IP header and (whole packet quoted) the quoted L4 checksum."""
    if len(b) < l3 + 20 or b[l3] >> 4 != 4 or (b[l3] & 15) < 5:
        return b
    hl, tot = (b[l3] & 15) * 4, _be16(b, l3 + 2)
    if l3 + hl > len(b):
        return b
    if not _be16(b, l3 + 6) & 0x3FFF and hl <= tot and l3 + tot <= len(b):
        l4 = l3 + hl
        if b[l3 + 9] == ICMP and l3 + tot - l4 >= 28 and b[l4] in ICMP_ERRORS:
            inner, iend = l4 + 8, l3 + tot
            ihl = (b[inner] & 15) * 4
            if b[inner] >> 4 == 4 and ihl >= 20 and inner + ihl <= iend:
                if not _be16(b, inner + 6) & 0x3FFF and inner + _be16(b, inner + 2) <= iend:
                    fix_l4(b, inner)
                fix_ip(b, inner)
        fix_l4(b, l3)
    fix_ip(b, l3)
    return b


# --- frames ----------------------------------------------------------------------------------
def eth(payload: bytes, src: bytes = CLIENT_MAC, dst: bytes = NODE_MAC, ethertype: int = 0x0800) -> bytearray:
    return bytearray(dst + src + ethertype.to_bytes(2, "big") + payload)


def ipv4(src: bytes, dst: bytes, proto: int, payload: bytes, ident: int = 0, frag: int = 0,
         options: bytes = b"", ttl: int = 64, tos: int = 0) -> bytes:
    """An IPv4 packet, header checksum left zero (fix() fills it)."""
    hl = 20 + len(options)
    return struct.pack("!BBHHHBBH4s4s", 0x40 | hl // 4, tos, hl + len(payload), ident & 0xFFFF, frag,
                       ttl, proto, 0, src, dst) + options + payload


def tcp(sport: int, dport: int, flags: int = 0x18, seq: int = 1000, ack: int = 0, payload: bytes = b"",
        options: bytes = b"") -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, seq, ack, (5 + len(options) // 4) << 4, flags, 64240,
                       0, 0) + options + payload


def udp(sport: int, dport: int, payload: bytes = b"", csum: bool = True) -> bytes:
    # A non-zero placeholder means "compute it" to fix(); zero means "no checksum".
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 1 if csum else 0) + payload


def icmp(type_: int, code: int, body: bytes, rest: int = 0) -> bytes:
    return struct.pack("!BBHI", type_, code, 0, rest) + body


def packet(src, dst, proto, l4: bytes, **kw) -> bytearray:
    """A whole Ethernet frame with right checksums."""
    return fix(eth(ipv4(src, dst, proto, l4, **kw)))


# --- what the datapath must leave alone: parse.h's contract, independently --------------------
@dataclass
class Parsed:
    ok: bool               # parse.h accepts it (else: passed untouched, counted malformed)
    why: str = ""
    hl: int = 0
    tot: int = 0
    proto: int = 0
    mf: bool = False
    off: int = 0
    ident: int = 0
    l4: int = 0            # absolute offset of the L4 header
    end: int = 0           # absolute offset of the end of the IP datagram (14 + tot_len)

    @property
    def fragment(self) -> bool:
        return self.mf or self.off > 0


def parse(f) -> Parsed:
    n = len(f)
    if n < 14 or f[12] != 0x08 or f[13] != 0x00:
        return Parsed(False, "not ipv4")
    if n < 34:
        return Parsed(False, "ip header cut")
    v, hl = f[14] >> 4, (f[14] & 15) * 4
    if v != 4 or hl < 20:
        return Parsed(False, "bad version/ihl")
    if 14 + hl > n:
        return Parsed(False, "options past the frame")
    tot = _be16(f, 16)
    if tot < hl or tot > n - 14:
        return Parsed(False, "bad total length")
    fo = _be16(f, 20)
    p = Parsed(True, "", hl, tot, f[23], bool(fo & 0x2000), fo & 0x1FFF, _be16(f, 18), 14 + hl, 14 + tot)
    if p.off == 0:
        avail = tot - hl
        if p.proto == TCP:
            if avail < 20:
                return Parsed(False, "tcp header cut")
            doff = (f[p.l4 + 12] >> 4) * 4
            if doff < 20:
                return Parsed(False, "tcp doff < 5")
            if doff > avail:
                return Parsed(False, "tcp options cut")
        elif p.proto in (UDP, ICMP) and avail < 8:
            return Parsed(False, "l4 header cut")
    return p


def addresses(f, p: Parsed) -> tuple[bytes, ...]:
    """Outer addresses, and for an ICMP error the quoted ones."""
    out = (bytes(f[26:30]), bytes(f[30:34]))
    if p.proto == ICMP and p.off == 0 and p.end - p.l4 >= 28 and f[p.l4] in ICMP_ERRORS:
        q = p.l4 + 8
        out += (bytes(f[q + 12:q + 16]), bytes(f[q + 16:q + 20]))
    return out


def allowed_offsets(f, p: Parsed) -> set[int]:
    """Bytes a translation may change: addresses, ports, checksums (outer, and quoted
    inside an ICMP error); all inside the IP datagram."""
    ok = set(range(24, 34))                   # IP checksum, source, destination
    if p.off == 0 and p.proto in (TCP, UDP):
        ok.update(range(p.l4, p.l4 + 4))
        c = p.l4 + L4_CSUM_OFF[p.proto]
        ok.update((c, c + 1))
    elif p.off == 0 and not p.mf and p.proto == ICMP and f[p.l4] in ICMP_ERRORS:
        q = p.l4 + 8
        ok.update((p.l4 + 2, p.l4 + 3))
        if q + 20 <= p.end:
            ok.update(range(q + 10, q + 20))
            ql4 = q + (f[q] & 15) * 4
            ok.update(range(ql4, ql4 + 4))
            if f[q + 9] in (TCP, UDP):
                c = ql4 + L4_CSUM_OFF[f[q + 9]]
                ok.update((c, c + 1))
    return {o for o in ok if o < p.end}


def checksums(f, p: Parsed) -> dict[str, bool]:
    """Every checksum of the frame that can be judged, valid or not; bounded by tot_len."""
    out = {"ip": csum_valid(f[14:p.l4])}
    if p.fragment or p.proto not in L4_CSUM_OFF:
        return out
    seg = f[p.l4:p.end]
    if p.proto == ICMP:
        out["icmp"] = csum_valid(seg)
        q = p.l4 + 8
        if seg[0] in ICMP_ERRORS and q + 20 <= p.end and f[q] >> 4 == 4 and (f[q] & 15) >= 5:
            qhl = (f[q] & 15) * 4
            if q + qhl <= p.end:
                out["quoted ip"] = csum_valid(f[q:q + qhl])
            qtot, qproto = _be16(f, q + 2), f[q + 9]
            # The quoted L4 checksum can only be judged when the whole packet is quoted.
            if qproto in (TCP, UDP) and qtot >= qhl and q + qtot <= p.end and not _be16(f, q + 6) & 0x3FFF:
                c = q + qhl + L4_CSUM_OFF[qproto]
                if c + 2 <= q + qtot and not (qproto == UDP and f[c] == 0 and f[c + 1] == 0):
                    out["quoted l4"] = csum_valid(pseudo(f[q + 12:q + 16], f[q + 16:q + 20], qproto, qtot - qhl),
                                                  f[q + qhl:q + qtot])
        return out
    c = p.l4 + L4_CSUM_OFF[p.proto]
    if p.proto == UDP and f[c] == 0 and f[c + 1] == 0:
        out["udp zero"] = True
        return out
    out["l4"] = csum_valid(pseudo(f[26:30], f[30:34], p.proto, p.tot - p.hl), seg)
    return out


# --- running frames ---------------------------------------------------------------------------
class Runner:
    """BPF_PROG_TEST_RUN with buffers made once (the loop's cost is the syscall, not ctypes)."""

    MAX = 2048

    def __init__(self, hook: str, fd: int):
        self.hook, self.fd = hook, fd
        self.inbuf = ctypes.create_string_buffer(self.MAX)
        self.outbuf = ctypes.create_string_buffer(self.MAX + 256)
        self.opts = bpfsys.TestRunOpts(sz=ctypes.sizeof(bpfsys.TestRunOpts),
                                       data_in=ctypes.addressof(self.inbuf),
                                       data_out=ctypes.addressof(self.outbuf), repeat=1)
        self._ref = ctypes.byref(self.opts)
        self._run = bpfsys.lib().bpf_prog_test_run_opts
        self._out = ctypes.addressof(self.outbuf)

    def refused(self, frame) -> bool:
        """Frames the kernel's skb test run refuses (EINVAL) before any program runs: an
        IPv4 frame shorter than an IP header, an IPv6 one shorter than an IPv6 header."""
        if self.hook != "tc":
            return len(frame) < 14
        et = bytes(frame[12:14])
        return len(frame) < 14 or (et == b"\x08\x00" and len(frame) < 34) or (et == b"\x86\xdd" and len(frame) < 54)

    def run(self, frame) -> tuple[int, bytes]:
        n = len(frame)
        ctypes.memmove(self.inbuf, bytes(frame), n)
        self.opts.data_size_in = n
        self.opts.data_size_out = self.MAX + 256
        bpfsys.check(self._run(self.fd, self._ref), f"BPF_PROG_TEST_RUN at {self.hook}")
        return self.opts.retval, ctypes.string_at(self._out, self.opts.data_size_out)


# --- the oracle -------------------------------------------------------------------------------
@dataclass
class Meta:
    """What the generator knows about a frame beyond its bytes."""

    category: str
    expect: Callable[["Fuzzer", bytes, str, bytes], list[str]] | None = None  # extra, strict checks
    train: "Train | None" = None
    piece: tuple[int, int] | None = None   # fragment: (offset in bytes, length) of its payload


@dataclass
class Failure:
    hook: str
    category: str
    frame: bytes
    verdict: int
    out: bytes
    problems: list[str]

    def __str__(self) -> str:
        return (f"{self.hook} {self.category}: {'; '.join(self.problems)}\n  in  {self.frame.hex()}\n"
                f"  out {self.out.hex()} (verdict {self.verdict:#x})")


def judge(hook: str, f: bytes, verdict: int, out: bytes, translated_frags: dict) -> tuple[str, list[str]]:
    """The general oracle: (outcome, problems) for one frame. Outcomes: untouched,
    rewritten, dropped, rejected."""
    kind = VERDICTS[hook].get(verdict)
    p = parse(f)
    must_pass = None
    if not p.ok:
        must_pass = f"malformed ({p.why})"
    elif p.off > 0 and (bytes(f[26:34]) + bytes((p.proto,)) + p.ident.to_bytes(2, "big")) not in translated_frags:
        must_pass = "later fragment before its first"
    elif not OURS.intersection(addresses(f, p)):
        must_pass = "not ours"
    if kind is None:
        return "bad verdict", [f"unexpected verdict {verdict:#x}"]
    if kind == "back":
        return "rejected", check_reject(f, p, out, must_pass)
    if len(out) != len(f):
        return kind, [f"{kind}: frame length {len(f)} -> {len(out)}"]
    if kind == "drop":
        problems = []
        if must_pass:
            problems.append(f"dropped, but {must_pass}: must pass untouched")
        elif f[30:34] not in SERVICE_ADDRS:
            problems.append(f"dropped a frame to {socket.inet_ntoa(f[30:34])}, not a service address")
        if out != f:
            problems.append("dropped frame was modified")
        return "dropped", problems
    if out == f:
        return "untouched", []
    if must_pass:
        return "rewritten", [f"rewritten, but {must_pass}: must pass untouched"]
    problems = []
    ok = allowed_offsets(f, p)
    bad = [i for i in range(len(f)) if f[i] != out[i] and i not in ok]
    if bad:
        where = "beyond the IP total length" if min(bad) >= p.end else "outside addresses/ports/checksums"
        problems.append(f"bytes changed {where} at {bad[:8]}")
    before, after = checksums(f, p), checksums(out, p)  # same structure: only allowed bytes changed
    for name, valid in before.items():
        if name == "udp zero":
            if "udp zero" not in after:
                problems.append("zero UDP checksum (none) was filled in")
        elif valid and not after.get(name, False):
            problems.append(f"{name} checksum invalid after the rewrite")
    return "rewritten", problems


def check_reject(f, p: Parsed, out: bytes, must_pass: str | None) -> list[str]:
    """A reject must be kube-proxy's: ICMP port unreachable from the address the client
    used, to the client, back to its MAC, quoting its IP header and 8 bytes."""
    problems = []
    if must_pass:
        problems.append(f"rejected, but {must_pass}: must pass untouched")
    if p.ok and (p.hl != 20 or p.fragment):
        problems.append("rejected a packet with IP options or a fragment (cannot be quoted: drop)")
    if p.ok and p.proto == ICMP and f[p.l4] in ICMP_ERRORS:
        problems.append("answered an ICMP error with an ICMP error")
    if p.ok and f[30:34] not in SERVICE_ADDRS:
        problems.append("rejected a frame not addressed to a service")
    if len(out) != 14 + 20 + 8 + 28:
        return problems + [f"reject frame is {len(out)} bytes, expected 70"]
    if out[0:6] != f[6:12] or out[6:12] != f[0:6] or out[12:14] != b"\x08\x00":
        problems.append("reject: Ethernet header not swapped back to the sender")
    if out[14] != 0x45 or _be16(out, 16) != 56 or out[23] != ICMP or _be16(out, 20) & 0x3FFF:
        problems.append("reject: bad IP header")
    if out[26:30] != f[30:34] or out[30:34] != f[26:30]:
        problems.append("reject: not from the destination back to the source")
    if (out[34], out[35]) != (3, 3):
        problems.append(f"reject: ICMP type/code {out[34]}/{out[35]}, expected 3/3")
    if not csum_valid(out[14:34]):
        problems.append("reject: IP checksum invalid")
    if not csum_valid(out[34:70]):
        problems.append("reject: ICMP checksum invalid")
    if out[42:70] != f[14:42]:
        problems.append("reject: quote is not the packet's first 28 bytes")
    return problems


# --- known datapath bugs ----------------------------------------------------------------------
@dataclass
class KnownBug:
    """A bug the fuzzer finds that is not fixed yet. Its frames are counted apart (and a
    test marked xfail(strict=True) says it is still there); match() must be narrow enough
    that no other bug hides behind it."""

    name: str
    reason: str
    match: Callable[["Fuzzer", Runner, bytes, list[str]], bool]


def _icmp_quote_bound(fz: "Fuzzer", runner: Runner, f: bytes, problems: list[str]) -> bool:
    """nat.h icmp_error_nat bounds the quoted L4 checksum (and port check) by the frame's
    end, not by the IP total length: with bytes after tot_len it rewrites them and folds
    the change into the ICMP checksum. Matches when the frame is an ICMP error with
    trailing bytes, every problem is the ICMP checksum or a change past tot_len, and the
    same frame without its trailing bytes passes the oracle."""
    p = parse(f)
    if not p.ok or p.proto != ICMP or p.end >= len(f) or f[p.l4] not in ICMP_ERRORS:
        return False
    if not all(x == "icmp checksum invalid after the rewrite" or "beyond the IP total length" in x
               for x in problems):
        return False
    stripped = f[:p.end]
    verdict, out = runner.run(stripped)
    _, again = judge(runner.hook, stripped, verdict, out, fz.translated_frags)
    return not again


KNOWN_BUGS: list[KnownBug] = []
"""Empty now. _icmp_quote_bound stays as the pattern (and for checking an old tree): it
matched 150-ish frames per 100k on a8bd463, before nat.h bounded the quote by tot_len.
To register a bug: KnownBug("name", "reproducer and where", match)."""


# --- flows and fragment trains ----------------------------------------------------------------
@dataclass
class Flow:
    """A flow made by real frames: client:cport -> front:fport, seen by the backend as
    src:sport -> backend:8080 (src:sport is the masquerade address and port, or the client's)."""

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

    def l4(self, sport, dport, payload=b"", flags=0x18, seq=1000):
        if self.proto == TCP:
            return tcp(sport, dport, flags, seq, 1, payload)
        return udp(sport, dport, payload)

    def forward(self, payload=b"", flags=0x18) -> bytearray:
        """What the client sends."""
        return packet(self.client, self.front, self.proto, self.l4(self.cport, self.fport, payload, flags))

    def at_backend(self, payload=b"", flags=0x18) -> bytes:
        """The client's packet as the backend received it (IP only)."""
        return bytes(fix(eth(ipv4(self.src, self.backend, self.proto,
                                  self.l4(self.sport, BACKEND_PORT, payload, flags)))))[14:]

    def reply(self, payload=b"", flags=0x18) -> bytearray:
        """What the backend sends back."""
        return packet(self.backend, self.src, self.proto, self.l4(BACKEND_PORT, self.sport, payload, flags))

    def at_client(self, payload=b"", flags=0x18) -> bytes:
        """The backend's reply as the client received it (IP only)."""
        return bytes(fix(eth(ipv4(self.front, self.client, self.proto,
                                  self.l4(self.fport, self.cport, payload, flags)))))[14:]


@dataclass
class Train:
    """One fragmented datagram sent as pieces: later pieces must follow the translation of
    the first (same new addresses), and the reassembled output must carry a valid L4
    checksum."""

    datagram: bytes                    # the whole IP datagram (checksums valid)
    pieces_left: int
    translated: tuple[bytes, bytes] | None = None
    outputs: dict = field(default_factory=dict)   # payload offset -> output payload
    overlapping: bool = False
    broken: bool = False               # a piece dropped/untouched: no reassembly check


def fragments(datagram: bytes, cuts: list[int], ident: int) -> list[tuple[int, int, bytes]]:
    """Split an IP datagram's payload at the given byte offsets (multiples of 8):
    (offset, length, IP packet) per piece."""
    hl = (datagram[0] & 15) * 4
    hdr, payload = datagram[:hl], datagram[hl:]
    bounds = [0] + cuts + [len(payload)]
    out = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        mf = 0x2000 if i < len(bounds) - 2 else 0
        out.append((a, b - a, _frag_packet(hdr, payload[a:b], a, mf, ident)))
    return out


def _frag_packet(hdr: bytes, piece: bytes, offset: int, mf: int, ident: int) -> bytes:
    h = bytearray(hdr)
    _put16(h, 2, len(h) + len(piece))
    _put16(h, 4, ident & 0xFFFF)
    _put16(h, 6, mf | offset // 8)
    _put16(h, 10, 0)
    _put16(h, 10, csum_compute(h))
    return bytes(h) + piece


# --- the fuzzer -----------------------------------------------------------------------------
IP_OPTIONS = [b"\x01", b"\x00", b"\x94\x04\x00\x00", b"\x07\x07\x04\x00\x00\x00\x00",
              b"\x44\x0c\x05\x00" + bytes(8), b"\x83\x07\x04" + bytes(4), b"\x01\x01\x01"]


class FuzzerBase:
    """What both families' fuzzers share: one seed, the bookkeeping of outcomes and
    failures, sending a frame and judging it, opening flows, and the mutations that do
    not depend on the IP header. A family says how to judge (``judge``), where a frame's
    addresses and ports are (``SRC``, ``DST``, ``parse_l4``), and what it generates."""

    KEEP = 50  # failures kept per category (all are counted)
    NAME = ""
    FLIP_END = 90    # byte flips land in the headers: up to this offset
    FLOW_KINDS = ("pod-cip-tcp", "pod-cip-udp", "outside-cip-tcp", "outside-nodeport-tcp", "outside-nodeport-udp",
                  "pod-nodeport-udp")
    # A family's addresses and flow type (class attributes of the subclass):
    # PODS, OUTSIDE, NODE, CIP, BACKENDS, Flow, MUTATIONS; and l4_offset(frame).

    def __init__(self, table: ServiceTable, runners: dict[str, Runner], seed: int):
        self.table, self.runners, self.seed = table, runners, seed
        self.rnd = random.Random(seed)
        self.counts: dict[str, Counter] = {h: Counter() for h in runners}         # (category, outcome)
        self.verdicts: dict[str, Counter] = {h: Counter() for h in runners}
        self.failures: dict[str, list[Failure]] = defaultdict(list)               # category -> failures
        self.failed: Counter = Counter()                                          # category -> count
        self.ports_exhausted: Counter = Counter()                                 # hook -> new flows
        self.known: dict[str, list[Failure]] = defaultdict(list)                  # bug name -> frames
        self.frames = 0                                                           # run through a program
        self.judged: Counter = Counter()                                          # per hook
        self.seconds = 0.0
        self._port = 1024 + self.rnd.randrange(20000)

    # -- what a family defines
    def judge(self, hook: str, f: bytes, verdict: int, out: bytes) -> tuple[str, list[str]]:
        raise NotImplementedError

    @staticmethod
    def l4_offset(frame: bytes) -> int:
        raise NotImplementedError

    def learn(self, f: bytes, outcome: str, out: bytes) -> None:
        """Note what the oracle must know about later frames (a translated first fragment)."""

    def follow(self, meta: Meta, f: bytes, outcome: str, out: bytes) -> list[str]:
        """Checks across the pieces of a fragment train (``meta.train``)."""
        return []

    def fix(self, frame: bytearray) -> bytearray:
        """The frame's checksums made right, as its sender would have."""
        return frame

    def extra_frames(self) -> list[tuple[bytearray, str]]:
        """Frames sent every round besides the valid ones and a mutation."""
        return []

    # -- bookkeeping
    def port(self) -> int:
        self._port = 1024 + (self._port - 1024 + 1) % 64000
        return self._port

    def payload(self, most: int = 48) -> bytes:
        return self.rnd.randbytes(self.rnd.randrange(most + 1))

    def fail(self, hook: str, meta: Meta, f: bytes, verdict: int, out: bytes, problems: list[str]) -> None:
        failure = Failure(hook, meta.category, bytes(f), verdict, out, problems)
        for bug in KNOWN_BUGS:
            if bug.match(self, self.runners[hook], bytes(f), problems):
                self.known[bug.name].append(failure)
                self.counts[hook][(meta.category, "known bug")] += 1
                return
        self.failed[meta.category] += 1
        if len(self.failures[meta.category]) < self.KEEP:  # a million-frame run keeps reproducers, not all
            self.failures[meta.category].append(failure)

    def send(self, hook: str, frame, meta: Meta) -> tuple[str, int, bytes]:
        runner = self.runners[hook]
        f = bytes(frame)
        try:
            verdict, out = runner.run(f)
        except OSError:
            if not runner.refused(f):
                raise
            self.counts[hook][(meta.category, "refused by the kernel")] += 1
            return "refused", -1, b""
        self.frames += 1
        self.judged[hook] += 1
        self.verdicts[hook][verdict] += 1
        outcome, problems = self.judge(hook, f, verdict, out)
        self.learn(f, outcome, out)
        if meta.expect:
            problems = problems + meta.expect(self, f, outcome, out)
        if meta.train is not None:
            problems = problems + self.follow(meta, f, outcome, out)
        self.counts[hook][(meta.category, outcome)] += 1
        if problems:
            self.fail(hook, meta, f, verdict, out, problems)
        return outcome, verdict, out

    # -- setup: flows made by real frames
    def make_flow(self, hook: str, kind: str):
        """A flow of ``kind`` (FLOW_KINDS), opened by real frames: its first packet and
        the backend's answer run through the program, and the flow learns its backend
        and masquerade address and port from the output. None if it could not open."""
        rnd = self.rnd
        proto = TCP if kind.endswith("tcp") else UDP
        pod = kind.startswith("pod")
        client = rnd.choice(self.PODS if pod else self.OUTSIDE)
        if "nodeport" in kind:
            front, fport = self.NODE, NP_TCP if proto == TCP else NP_UDP
        else:
            front, fport = self.CIP, TCP_PORT if proto == TCP else UDP_PORT
        fl = self.Flow(proto, client, self.port(), front, fport)
        masq = not pod or front == self.NODE
        return fl if self._open_flow(hook, kind, fl, masq) else None

    def _open_flow(self, hook: str, kind: str, fl, masq: bool) -> bool:
        client, front, fport = fl.client, fl.front, fl.fport
        node, backends, parse_l4 = self.NODE, self.BACKENDS, self.l4_offset
        # The fuzzer opens masqueraded flows faster than they expire (UDP: 30 s), so the
        # masquerade ports to a backend can run out: a drop is right then, if counted so.
        no_port = self.table.datapath_counters()["snat_no_port"] if masq else 0
        src_at, dst_at = self.SRC, self.DST

        def opened(fz, f, outcome, out):
            if outcome == "dropped" and masq and fz.table.datapath_counters()["snat_no_port"] > no_port:
                fz.ports_exhausted[hook] += 1
                return []
            if outcome != "rewritten":
                return [f"new flow ({kind}) not translated: {outcome}"]
            l4 = parse_l4(out)
            fl.backend, fl.src, fl.sport = bytes(out[dst_at]), bytes(out[src_at]), _be16(out, l4)
            problems = []
            if fl.backend not in backends or _be16(out, l4 + 2) != BACKEND_PORT:
                problems.append("new flow not sent to a backend")
            if masq and fl.src != node:
                problems.append("flow from outside not masqueraded")
            if not masq and (fl.src, fl.sport) != (client, fl.cport):
                problems.append("pod's flow to a cluster IP masqueraded")
            return problems

        outcome, _, _ = self.send(hook, fl.forward(flags=0x02), Meta("setup", opened))
        if outcome != "rewritten" or fl.backend not in backends:
            return False

        def answered(fz, f, outcome, out):
            if outcome != "rewritten":
                return [f"reply of {kind} not translated: {outcome}"]
            l4 = parse_l4(out)
            if (bytes(out[src_at]), _be16(out, l4), bytes(out[dst_at]), _be16(out, l4 + 2)) != \
                    (front, fport, client, fl.cport):
                return ["reply not translated back to the frontend and the client"]
            return []

        self.send(hook, fl.reply(flags=0x12), Meta("setup", answered))
        return True

    # -- mutations that do not depend on the IP header (each returns (frame, category) pairs)
    def m_truncate(self, frames):
        f = self.rnd.choice(frames)
        return [(f[:cut], "truncate") for cut in range(14, len(f))]

    def m_truncate_consistent(self, frames):
        """Cut the IP datagram short and say so in its length field: a consistent,
        shorter packet (``LENGTH``: the field's offset, the bytes before what it counts,
        the shortest cut, the category)."""
        at, before, shortest, category = self.LENGTH
        f = self.rnd.choice(frames)
        out = []
        for cut in range(shortest, len(f)):
            g = bytearray(f[:cut])
            _put16(g, at, cut - before)
            out.append((self.fix(g), category))
        return out

    def m_trailing(self, frames):
        f = self.rnd.choice(frames)
        n = self.rnd.randrange(1, 40)
        tail = bytes(n) if self.rnd.random() < .5 else self.rnd.randbytes(n)   # padding, or garbage
        return [(bytearray(f) + tail, "trailing bytes")]

    def m_flip(self, frames):
        f = bytearray(self.rnd.choice(frames))
        rnd = self.rnd
        for _ in range(rnd.randrange(1, 4)):
            i = rnd.randrange(12, min(len(f), self.FLIP_END))
            f[i] ^= 1 << rnd.randrange(8) if rnd.random() < .7 else rnd.randrange(1, 256)
        return [(self.fix(f) if rnd.random() < .7 else f, "byte flips")]

    def m_vlan(self, frames):
        f = self.rnd.choice(frames)
        tags = b"\x81\x00" + self.rnd.randbytes(2)
        if self.rnd.random() < .3:
            tags = b"\x88\xa8" + self.rnd.randbytes(2) + tags
        return [(bytearray(f[:12] + tags + f[12:]), "vlan")]


class Fuzzer(FuzzerBase):
    """The IPv4 frames: generates rounds of frames for both hooks from one seed and
    judges every output."""

    NAME = "IPv4"
    SRC, DST = slice(26, 30), slice(30, 34)
    LENGTH = (16, 14, 34, "truncate+tot_len")   # tot_len counts from the IP header
    PODS, OUTSIDE, NODE, CIP, BACKENDS = PODS, OUTSIDE, NODE_IP, CIP, BACKENDS

    def __init__(self, table: ServiceTable, runners: dict[str, Runner], seed: int):
        super().__init__(table, runners, seed)
        self.translated_frags: dict[bytes, tuple[bytes, bytes]] = {}
        self._ident = self.rnd.randrange(65536)

    @staticmethod
    def l4_offset(frame: bytes) -> int:
        return parse(frame).l4

    def ident(self) -> int:
        self._ident = (self._ident + 1) & 0xFFFF
        return self._ident

    def judge(self, hook, f, verdict, out):
        return judge(hook, f, verdict, out, self.translated_frags)

    def learn(self, f, outcome, out):
        if outcome == "rewritten":
            p = parse(f)
            if p.ok and p.mf and p.off == 0:  # a translated first fragment: its train follows it
                self.translated_frags[bytes(f[26:34]) + bytes((p.proto,)) + p.ident.to_bytes(2, "big")] = \
                    (out[26:30], out[30:34])

    def fix(self, frame):
        return fix(frame)

    def follow(self, meta, f, outcome, out):
        return self._follow(meta, f, outcome, out)

    def _follow(self, meta: Meta, f: bytes, outcome: str, out: bytes) -> list[str]:
        """Fragment trains: later pieces translated like the first, reassembly checked."""
        t, problems = meta.train, []
        off, length = meta.piece
        p = parse(f)
        if off == 0 and outcome == "rewritten" and p.ok and p.mf:
            t.translated = (out[26:30], out[30:34])
        elif off > 0 and t.translated is not None:
            if outcome != "rewritten" or (out[26:30], out[30:34]) != t.translated:
                problems.append("later fragment did not follow its first fragment's translation")
        if outcome == "rewritten" and p.ok:
            t.outputs.setdefault(off, out[p.l4:p.end])
        else:
            t.broken = True
        t.pieces_left -= 1
        if t.pieces_left == 0 and not t.broken and not t.overlapping and t.translated:
            payload = b"".join(t.outputs[k] for k in sorted(t.outputs))
            hl = (t.datagram[0] & 15) * 4
            proto = t.datagram[9]
            if len(payload) == len(t.datagram) - hl and proto in (TCP, UDP):
                c = L4_CSUM_OFF[proto]
                if not (proto == UDP and payload[c:c + 2] == b"\0\0"):
                    if not csum_valid(pseudo(t.translated[0], t.translated[1], proto, len(payload)), payload):
                        problems.append("reassembled datagram's L4 checksum invalid after translation")
        return problems

    # -- templates
    def valid_frames(self, flows: list[Flow]) -> list[bytearray]:
        """Frames of every kind the datapath handles, all well-formed."""
        rnd, pl = self.rnd, self.payload
        pod, out = rnd.choice(PODS), rnd.choice(OUTSIDE)
        fl = rnd.choice(flows)
        frames = [
            fl.forward(pl()), fl.reply(pl()),
            packet(pod, CIP, TCP, tcp(self.port(), TCP_PORT, 0x02, payload=pl())),          # new flows
            packet(out, CIP, UDP, udp(self.port(), UDP_PORT, pl())),
            packet(out, NODE_IP, TCP, tcp(self.port(), NP_TCP, 0x02)),
            packet(pod, NODE_IP, UDP, udp(self.port(), NP_UDP, pl(), csum=False)),
            packet(pod, EMPTY, TCP, tcp(self.port(), 80, 0x02)),                             # reject
            packet(out, EMPTY, UDP, udp(self.port(), 80, pl())),
            packet(out, NODE_IP, TCP, tcp(self.port(), NP_EMPTY, 0x02)),
            packet(pod, CIP, TCP, tcp(self.port(), 81, 0x02)),                               # bad port
            packet(pod, CIP, ICMP, icmp(8, 0, pl(), 0x12340001)),                            # ping a CIP
            packet(pod, UNALLOCATED, UDP, udp(self.port(), 80, pl())),                       # drop
            packet(pod, CIP, 47, pl()),                                                      # GRE
            packet(rnd.choice(FOREIGN), rnd.choice(FOREIGN), TCP, tcp(self.port(), 80, 0x18, payload=pl())),
            packet(pod, rnd.choice(BACKENDS), TCP, tcp(self.port(), BACKEND_PORT, 0x02)),    # pod -> pod
            packet(fl.client, fl.backend, fl.proto, fl.l4(fl.cport, BACKEND_PORT, pl())),    # same ports, direct
        ]
        return frames

    def icmp_error(self, fl: Flow, from_backend: bool, qlen: int | None = None) -> bytearray:
        """An ICMP error about one of the flow's packets, quoting qlen bytes of it."""
        rnd = self.rnd
        inner = fl.at_backend(self.payload(16)) if from_backend else fl.at_client(self.payload(16))
        if qlen is None:
            qlen = rnd.choice((28, 28, 40, len(inner), rnd.randrange(len(inner) + 1)))
        type_ = rnd.choice((3, 3, 11, 12))
        code = {3: rnd.choice((3, 1, 4, 13)), 11: 0, 12: 0}[type_]
        rest = 1500 if (type_, code) == (3, 4) else 0
        body = icmp(type_, code, inner[:qlen], rest)
        if from_backend:
            src = fl.backend if rnd.random() < .8 else rnd.choice(FOREIGN)     # or a router on the way
            return packet(src, fl.src, ICMP, body)
        return packet(fl.client, fl.front, ICMP, body)

    # -- mutations (each returns (frame, category) pairs)
    def m_ihl(self, frames):
        f = self.rnd.choice(frames)
        out = []
        for ihl in range(16):
            g = bytearray(f)
            g[14] = 0x40 | ihl
            out.append((fix_ip_only(g), "ihl"))
        return out

    def m_tot_len(self, frames):
        f = self.rnd.choice(frames)
        hl, real = (f[14] & 15) * 4, len(f) - 14
        values = {0, 1, 19, 20, hl - 1, hl, hl + 1, hl + 7, hl + 8, hl + 19, hl + 20, real - 1, real, real + 1,
                  0xFFFF, self.rnd.randrange(0x10000), self.rnd.randrange(real + 1)}
        out = []
        for v in sorted(x for x in values if 0 <= x <= 0xFFFF):
            g = bytearray(f)
            _put16(g, 16, v)
            out.append((fix(g) if self.rnd.random() < .7 else fix_ip_only(g), "tot_len"))
        return out

    def m_doff(self, frames):
        f = self.rnd.choice([g for g in frames if g[23] == TCP] or frames)
        out = []
        for doff in range(16):
            g = bytearray(f)
            if g[23] == TCP and len(g) > 14 + (g[14] & 15) * 4 + 12:
                l4 = 14 + (g[14] & 15) * 4
                g[l4 + 12] = doff << 4
            out.append((fix(g), "doff"))
        return out

    def m_options(self, frames):
        f = self.rnd.choice(frames)
        rnd = self.rnd
        hl = (f[14] & 15) * 4
        opts = b""
        while True:
            o = rnd.choice(IP_OPTIONS) if rnd.random() < .8 else rnd.randbytes(rnd.randrange(1, 8))
            if len(opts) + len(o) > 40:
                break
            opts += o
            if rnd.random() < .4:
                break
        opts += bytes(-len(opts) % 4)
        g = bytearray(f[:14 + hl] + opts + f[14 + hl:])
        g[14] = 0x40 | (hl + len(opts)) // 4
        _put16(g, 16, _be16(g, 16) + len(opts))
        return [(fix(g), "ip options")]

    def m_ethertype(self, frames):
        f = bytearray(self.rnd.choice(frames))
        et = self.rnd.choice((0x86DD, 0x0806, 0x8100, 0x88A8, 0x0000, 0xFFFF, 0x0801, 0x0008, 0x8847,
                              self.rnd.randrange(0x10000)))
        if et == 0x0800:
            et = 0x0801
        if et == 0x86DD and len(f) < 54:
            f += bytes(54 - len(f))
        f[12:14] = et.to_bytes(2, "big")
        return [(f, "ethertype")]

    def m_icmp(self, flows):
        fl, rnd = self.rnd.choice(flows), self.rnd
        g = self.icmp_error(fl, from_backend=rnd.random() < .6)
        cat = "icmp error (masqueraded flow)" if fl.masqueraded else "icmp error (tracked flow)"
        if rnd.random() < .15:  # a quoted header that lies
            q = 14 + 20 + 8
            if rnd.random() < .5 and len(g) > q:
                g[q] = 0x40 | rnd.randrange(16)
            elif len(g) > q + 4:
                _put16(g, q + 2, rnd.randrange(0x10000))
            g = fix(g)
            cat = "icmp error (bad quote)"
        return [(g, cat)]

    def m_icmp_trailing(self, flows):
        """ICMP errors about tracked flows with bytes after the IP total length."""
        fl, rnd = self.rnd.choice(flows), self.rnd
        g = self.icmp_error(fl, from_backend=rnd.random() < .6, qlen=rnd.choice((28, 28, 20 + 4, 20 + 12, 40)))
        g += rnd.randbytes(rnd.randrange(1, 30)) if rnd.random() < .5 else bytes(rnd.randrange(1, 30))
        return [(g, "icmp error + trailing bytes")]

    def m_udp_csum_edge(self, flows):
        """UDP payloads chosen so that a checksum computes to zero, which UDP sends as
        0xffff (zero means "no checksum"): on the translated packet (the rewrite must
        produce 0xffff, not 0) or on the packet sent (the update starts from 0xffff)."""
        rnd = self.rnd
        udp_flows = [fl for fl in flows if fl.proto == UDP]
        if not udp_flows:
            return []
        fl = rnd.choice(udp_flows)
        reply = rnd.random() < .5
        payload = rnd.randbytes(2 * rnd.randrange(16)) + b"\0\0"
        make = fl.reply if reply else fl.forward
        if rnd.random() < .7:   # aim at the translated packet
            target = packet(fl.front, fl.client, UDP, udp(fl.fport, fl.cport, payload)) if reply else \
                packet(fl.src, fl.backend, UDP, udp(fl.sport, BACKEND_PORT, payload))
        else:
            target = make(payload)
        target[40:42] = b"\0\0"                 # the UDP checksum (no IP options here)
        x = csum_compute(pseudo(target[26:30], target[30:34], UDP, len(target) - 34), target[34:])
        return [(make(payload[:-2] + x.to_bytes(2, "big")), "udp checksum edge")]

    def m_fragments(self, flows):
        """A fragmented datagram sent in order, reversed, shuffled, with duplicates or
        overlaps, or without its first fragment."""
        rnd = self.rnd
        fl = rnd.choice(flows)
        pl = rnd.randbytes(rnd.randrange(24, 160))
        choice = rnd.randrange(5)
        if choice == 0:
            dg = fl.forward(pl)[14:]
        elif choice == 1:
            dg = fl.reply(pl)[14:]
        elif choice == 2:
            dg = packet(rnd.choice(OUTSIDE), rnd.choice((CIP, NODE_IP)), UDP,
                        udp(self.port(), rnd.choice((UDP_PORT, NP_UDP)), pl))[14:]
        elif choice == 3:
            dg = packet(rnd.choice(PODS), EMPTY, UDP, udp(self.port(), 80, pl))[14:]
        else:
            dg = packet(rnd.choice(FOREIGN), rnd.choice(FOREIGN), TCP, tcp(self.port(), 80, payload=pl))[14:]
        dg = bytes(dg)
        n = len(dg) - 20
        ident = self.ident()
        # Cut points: multiples of 8; a tiny first piece (8 bytes) cuts a TCP header.
        points = sorted(rnd.sample(range(8, n, 8), min(rnd.randrange(1, 4), len(range(8, n, 8)))))
        pieces = fragments(dg, points, ident)
        order = rnd.randrange(6)
        train = Train(dg, 0)
        if order == 1:
            pieces.reverse()
        elif order == 2:
            rnd.shuffle(pieces)
        elif order == 3:
            pieces.insert(rnd.randrange(len(pieces) + 1), pieces[0])   # first fragment twice
        elif order == 4 and len(pieces) > 1:                             # overlapping middle piece
            a = max(8, pieces[1][0] - 8)                                 # a later fragment, never the first
            b = min(n, pieces[1][0] + pieces[1][1] + 8)
            mf = 0x2000 if b < n else 0
            extra = _frag_packet(dg[:20], dg[20 + a:20 + b], a, mf, ident)
            pieces.insert(rnd.randrange(1, len(pieces) + 1), (a, b - a, extra))
            train.overlapping = True
        elif order == 5 and len(pieces) > 1:
            pieces = pieces[1:]                                          # the first never comes
        train.pieces_left = len(pieces)
        cat = {0: "fragments in order", 1: "fragments reversed", 2: "fragments shuffled", 3: "fragments, first twice",
               4: "fragments overlapping", 5: "fragments without the first"}[order]
        return [(eth(p), cat, Meta(cat, train=train, piece=(off, length))) for off, length, p in pieces]


def fix_ip_only(g: bytearray) -> bytearray:
    if len(g) >= 34 and (g[14] & 15) >= 5:
        fix_ip(g, 14)
    return g


MUTATIONS = [  # (weight, method name, input): ~ share of frames
    (3, "m_truncate", "frames"), (2, "m_truncate_consistent", "frames"), (2, "m_ihl", "frames"),
    (2, "m_tot_len", "frames"), (2, "m_doff", "frames"), (12, "m_options", "frames"), (12, "m_trailing", "frames"),
    (40, "m_flip", "frames"), (8, "m_ethertype", "frames"), (8, "m_vlan", "frames"), (30, "m_icmp", "flows"),
    (12, "m_icmp_trailing", "flows"), (12, "m_fragments", "flows"), (6, "m_udp_csum_edge", "flows"),
]
Fuzzer.MUTATIONS, Fuzzer.Flow = MUTATIONS, Flow


def run(fuzzer: FuzzerBase, hook: str, frames: int, round_size: int = 1500) -> None:
    """Rounds of: fresh flows through the program, then mutated frames about them, until
    ``frames`` frames have been judged on ``hook``."""
    start, goal = time.monotonic(), fuzzer.frames + frames
    rnd = fuzzer.rnd
    weights = [w for w, _, _ in fuzzer.MUTATIONS]
    while fuzzer.frames < goal:
        flows = [fl for fl in (fuzzer.make_flow(hook, k) for k in fuzzer.FLOW_KINDS) if fl]
        if not flows:
            raise AssertionError(f"{hook}: no {fuzzer.NAME} flow could be made: {dict(fuzzer.failures)}")
        end = min(goal, fuzzer.frames + round_size)
        while fuzzer.frames < end:
            base = fuzzer.valid_frames(flows)
            for f in rnd.sample(base, 2):
                fuzzer.send(hook, f, Meta("valid"))
            for f, cat in fuzzer.extra_frames():
                fuzzer.send(hook, f, Meta(cat))
            _, name, source = rnd.choices(fuzzer.MUTATIONS, weights)[0]
            for item in getattr(fuzzer, name)(base if source == "frames" else flows):
                frame, cat = item[0], item[1]
                fuzzer.send(hook, frame, item[2] if len(item) > 2 else Meta(cat))
    fuzzer.seconds += time.monotonic() - start


def report(fuzzer: FuzzerBase) -> str:
    """Frames per category and outcome, and verdicts, per hook."""
    lines = [f"kxlb fuzz ({fuzzer.NAME}): seed {fuzzer.seed}, {fuzzer.frames} frames in {fuzzer.seconds:.1f} s "
             f"({fuzzer.frames / max(fuzzer.seconds, 1e-9):.0f}/s)"]
    outcomes = ["untouched", "rewritten", "dropped", "rejected", "refused by the kernel", "known bug"]
    for hook, counts in fuzzer.counts.items():
        cats = sorted({c for c, _ in counts})
        lines.append(f"  {hook}: " + ", ".join(f"{VERDICTS[hook].get(v, '?')}({v:#x}) {n}"
                                                for v, n in sorted(fuzzer.verdicts[hook].items())))
        lines.append(f"    {'category':34}" + "".join(f"{o[:10]:>11}" for o in outcomes))
        for c in cats:
            lines.append(f"    {c:34}" + "".join(f"{counts[(c, o)]:>11}" for o in outcomes))
    for hook, n in fuzzer.ports_exhausted.items():
        lines.append(f"  {hook}: {n} set-up flows dropped for want of a masquerade port (counted snat_no_port)")
    for name, fs in fuzzer.known.items():
        lines.append(f"  known bug {name}: {len(fs)} frames")
    for cat, n in fuzzer.failed.items():
        lines.append(f"  FAILURES in {cat}: {n}")
    return "\n".join(lines)


CATEGORIES = (
    "setup", "valid", "truncate", "truncate+tot_len", "ihl", "tot_len", "doff", "ip options", "trailing bytes",
    "byte flips", "ethertype", "vlan", "icmp error (tracked flow)", "icmp error (masqueraded flow)",
    "icmp error (bad quote)", "icmp error + trailing bytes", "udp checksum edge", "fragments in order",
    "fragments reversed", "fragments shuffled", "fragments, first twice", "fragments overlapping", "fragments without the first",
)
