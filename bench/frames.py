"""Benchmark frames built with struct, in bulk, before any timing.

Building a frame with scapy takes about 100 us and walks a lot of Python between two
BPF_PROG_TEST_RUN calls, which leaves the program's caches cold: new-flow figures came
out about three times too high that way. These builders are about 50 times faster, so
tens of thousands of distinct frames can be prepared up front, and they lay frames out
byte for byte like Katran's anchor benchmark (../shared/anchors/katran/katran_bench.py):
Ethernet 02:..:01 -> 02:..:02, IPv4 id 1, TTL 64, TCP window 8192, 64 bytes of payload;
so kxlb and Katran run on the same bytes. An IPv6 address gives an Ethernet/IPv6 frame
(hop limit 64, the same L4 and payload) for the IPv6 rows. tests/test_bench.py checks
them against scapy (and so their checksums).
"""
from __future__ import annotations

import socket
import struct

ETH = bytes.fromhex("020000000002" "020000000001" "0800")  # dst, src, IPv4
ETH6 = ETH[:12] + b"\x86\xdd"                               # the same, IPv6
PAYLOAD = b"x" * 64
SYN, ACK = 0x02, 0x10


def csum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _ipv4(src: bytes, dst: bytes, proto: int, l4: bytes, df: bool = False) -> bytes:
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000 if df else 0, 64, proto, 0, src, dst)
    return hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:] + l4


def _ip(src: str, dst: str, proto: int, l4: bytes, sum_at: int, udp: bool = False, df: bool = False) -> bytes:
    """Ethernet + IPv4 or IPv6 (by the addresses) + ``l4`` with its checksum (the
    pseudo-header's sum) written at ``sum_at``; ``df``: IPv4's don't-fragment bit."""
    v6 = ":" in dst
    af = socket.AF_INET6 if v6 else socket.AF_INET
    s, d = socket.inet_pton(af, src), socket.inet_pton(af, dst)
    pseudo = s + d + (struct.pack("!IxxxB", len(l4), proto) if v6 else struct.pack("!BBH", 0, proto, len(l4)))
    sum_ = csum(pseudo + l4)
    if udp:
        sum_ = sum_ or 0xFFFF   # 0 means "no checksum" (and IPv6 forbids it)
    l4 = l4[:sum_at] + struct.pack("!H", sum_) + l4[sum_at + 2:]
    if v6:
        return ETH6 + struct.pack("!IHBB16s16s", 6 << 28, len(l4), proto, 64, s, d) + l4
    return ETH + _ipv4(s, d, proto, l4, df)


def tcp(src: str, sport: int, dst: str, dport: int, flags: int = ACK, payload: bytes = PAYLOAD,
        df: bool = False) -> bytes:
    """An Ethernet/IPv4/TCP frame (seq and ack 0, window 8192) with valid checksums
    (Ethernet/IPv6/TCP for IPv6 addresses)."""
    seg = struct.pack("!HHIIBBHHH", sport, dport, 0, 0, 5 << 4, flags, 8192, 0, 0) + payload
    return _ip(src, dst, socket.IPPROTO_TCP, seg, 16, df=df)


def udp(src: str, sport: int, dst: str, dport: int, payload: bytes = PAYLOAD) -> bytes:
    """An Ethernet/IPv4/UDP frame with valid checksums (Ethernet/IPv6/UDP for IPv6
    addresses)."""
    dgram = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    return _ip(src, dst, socket.IPPROTO_UDP, dgram, 6, udp=True)


PORTS_PER_ADDR = 50_000  # client ports 1024..51023 per source address, as Katran's bench


def fresh_clients(net: str, n: int) -> list[tuple[str, int]]:
    """``n`` distinct client (address, port) pairs in ``net`` ("10.64": 10.64.x.1;
    "fd00:64": fd00:64::x:1), in the order Katran's bench uses for its new flows: port
    first, then address."""
    if ":" in net:
        return [(f"{net}::{i // PORTS_PER_ADDR:x}:1", 1024 + i % PORTS_PER_ADDR) for i in range(n)]
    a, b = (int(x) for x in net.split("."))
    if n > PORTS_PER_ADDR * 256:
        raise ValueError(f"{n} clients do not fit in {net}.0.0/16 ({PORTS_PER_ADDR * 256} at most)")
    return [(f"{a}.{b}.{i // PORTS_PER_ADDR}.1", 1024 + i % PORTS_PER_ADDR) for i in range(n)]


def ip_dst(frame: bytes) -> tuple[str, int]:
    """(destination address, destination port) of an Ethernet/IPv4-or-IPv6/TCP-or-UDP
    frame (IPv6 without extension headers, as these builders make them)."""
    if frame[12:14] == ETH6[12:14]:
        return socket.inet_ntop(socket.AF_INET6, frame[38:54]), struct.unpack_from("!H", frame, 54 + 2)[0]
    ihl = (frame[14] & 0x0F) * 4
    return socket.inet_ntoa(frame[30:34]), struct.unpack_from("!H", frame, 14 + ihl + 2)[0]


def ip_src(frame: bytes) -> tuple[str, int]:
    """(source address, source port) of such a frame."""
    if frame[12:14] == ETH6[12:14]:
        return socket.inet_ntop(socket.AF_INET6, frame[22:38]), struct.unpack_from("!H", frame, 54)[0]
    ihl = (frame[14] & 0x0F) * 4
    return socket.inet_ntoa(frame[26:30]), struct.unpack_from("!H", frame, 14 + ihl)[0]
