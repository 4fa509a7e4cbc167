"""Benchmark frames built with struct, in bulk, before any timing.

Building a frame with scapy takes about 100 us and walks a lot of Python between two
BPF_PROG_TEST_RUN calls, which leaves the program's caches cold: new-flow figures came
out about three times too high that way. These builders are about 50 times faster, so
tens of thousands of distinct frames can be prepared up front, and they lay frames out
byte for byte like Katran's anchor benchmark (../shared/anchors/katran/katran_bench.py):
Ethernet 02:..:01 -> 02:..:02, IPv4 id 1, TTL 64, TCP window 8192, 64 bytes of payload;
so kxlb and Katran run on the same bytes. tests/test_bench_frames.py checks them against
scapy (and so their checksums).
"""
from __future__ import annotations

import socket
import struct

ETH = bytes.fromhex("020000000002" "020000000001" "0800")  # dst, src, IPv4
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


def _ipv4(src: bytes, dst: bytes, proto: int, l4: bytes) -> bytes:
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0, src, dst)
    return hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:] + l4


def tcp(src: str, sport: int, dst: str, dport: int, flags: int = ACK, payload: bytes = PAYLOAD) -> bytes:
    """An Ethernet/IPv4/TCP frame (seq and ack 0, window 8192) with valid checksums."""
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    seg = struct.pack("!HHIIBBHHH", sport, dport, 0, 0, 5 << 4, flags, 8192, 0, 0) + payload
    sum_ = csum(s + d + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(seg)) + seg)
    seg = seg[:16] + struct.pack("!H", sum_) + seg[18:]
    return ETH + _ipv4(s, d, socket.IPPROTO_TCP, seg)


def udp(src: str, sport: int, dst: str, dport: int, payload: bytes = PAYLOAD) -> bytes:
    """An Ethernet/IPv4/UDP frame with valid checksums."""
    s, d = socket.inet_aton(src), socket.inet_aton(dst)
    dgram = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    sum_ = csum(s + d + struct.pack("!BBH", 0, socket.IPPROTO_UDP, len(dgram)) + dgram) or 0xFFFF
    dgram = dgram[:6] + struct.pack("!H", sum_) + dgram[8:]
    return ETH + _ipv4(s, d, socket.IPPROTO_UDP, dgram)


PORTS_PER_ADDR = 50_000  # client ports 1024..51023 per source address, as Katran's bench


def fresh_clients(net: str, n: int) -> list[tuple[str, int]]:
    """``n`` distinct client (address, port) pairs in ``net`` ("10.64": 10.64.x.1), in
    the order Katran's bench uses for its new flows: port first, then address."""
    a, b = (int(x) for x in net.split("."))
    if n > PORTS_PER_ADDR * 256:
        raise ValueError(f"{n} clients do not fit in {net}.0.0/16 ({PORTS_PER_ADDR * 256} at most)")
    return [(f"{a}.{b}.{i // PORTS_PER_ADDR}.1", 1024 + i % PORTS_PER_ADDR) for i in range(n)]


def ipv4_dst(frame: bytes) -> tuple[str, int]:
    """(destination address, destination port) of an Ethernet/IPv4/TCP-or-UDP frame."""
    ihl = (frame[14] & 0x0F) * 4
    return socket.inet_ntoa(frame[30:34]), struct.unpack_from("!H", frame, 14 + ihl + 2)[0]


def ipv4_src(frame: bytes) -> tuple[str, int]:
    """(source address, source port) of an Ethernet/IPv4/TCP-or-UDP frame."""
    ihl = (frame[14] & 0x0F) * 4
    return socket.inet_ntoa(frame[26:30]), struct.unpack_from("!H", frame, 14 + ihl)[0]
