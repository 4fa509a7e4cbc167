"""SCTP Services in the datapath (BPF_PROG_TEST_RUN on tc and XDP, IPv4 and IPv6).

kube-proxy serves SCTP; kxlb 0.2 skipped SCTP ports, and an SCTP-only Service's cluster IP
dropped everything. SCTP's CRC32c covers the SCTP packet, not the IP header: address
translation leaves it alone, port translation (a NodePort, a targetPort that is not the
port, a masquerade port) changes it by an amount bpf/sctp.h computes from the port change
and the packet's length. Every translated packet here is judged by scapy's own CRC32c.

This kernel has no SCTP sockets (CONFIG_IP_SCTP unset), so SCTP is tested with frames
only; kube-proxy's netfilter has SCTP conntrack and NAT, which is what these mirror.
"""
from __future__ import annotations

import random
import struct

import pytest
from scapy.layers.inet import ICMP, IP, TCP, IPerror, fragment
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.layers.sctp import SCTP, SCTPChunkData, SCTPChunkInit, SCTPChunkInitAck, crc32c

from harness import assert_checksums, clean_table, eth
from kxlb.loader import conntrack, sctp
from kxlb.loader.layout import V4, V6, C, Backend, ServiceKey
from kxlb.loader.services import DatapathConfig
from kxlb.loader.svcspec import Frontend, Kind, LbService

SCTP_PROTO = 132
NODE_IP = "10.250.0.11"
POD = "10.0.0.2"
OUTSIDE = "192.0.2.9"
VIP = "10.96.0.30"
PORT, TARGET = 99, 3868          # a Diameter-like Service: port 99 -> targetPort 3868
SAME = 3868                      # a port whose targetPort is itself: addresses only
NODE_PORT = 30099
BACKENDS = (Backend("10.0.1.11", TARGET), Backend("10.0.2.11", TARGET))
BACKEND_ADDRS = {b.addr for b in BACKENDS}
EMPTY_VIP = "10.96.0.31"         # an SCTP-only Service without endpoints
VIP6, BACKEND6 = "fd00:96::30", "fd00:1::11"
CLIENT6 = "fd00:10::2"
CONFIG = DatapathConfig(snat_addrs=(NODE_IP,), cluster_cidrs=("10.0.0.0/16",),
                        service_cidrs=("10.96.0.0/16", "fd00:96::/112"))


@pytest.fixture
def table(dp):
    with clean_table(dp[1]) as t:
        t.set_config(CONFIG)
        t.put(LbService(key=ServiceKey(VIP, PORT, SCTP_PROTO), cluster=BACKENDS, has_endpoints=True,
                        frontends=(Frontend(ServiceKey(NODE_IP, NODE_PORT, SCTP_PROTO), Kind.NODE_PORT),),
                        name="default/diameter:s"))
        t.put(LbService.simple(ServiceKey(VIP, SAME, SCTP_PROTO), [Backend(b.addr, SAME) for b in BACKENDS]))
        t.put(LbService(key=ServiceKey(EMPTY_VIP, PORT, SCTP_PROTO), cluster=(), has_endpoints=False))
        t.put(LbService.simple(ServiceKey(VIP6, PORT, SCTP_PROTO), [Backend(BACKEND6, TARGET)]))
        yield t


def crc_of(sctp_bytes: bytes) -> bytes:
    """The CRC32c field an SCTP packet should carry, by scapy (RFC 9260 appendix B)."""
    zeroed = sctp_bytes[:8] + b"\0\0\0\0" + sctp_bytes[12:]
    return struct.pack(">I", crc32c(zeroed))   # scapy's value is byte-swapped to pack this way


def sctp_bytes(p) -> bytes:
    ip = p[IP] if IP in p else p[IPv6]
    length = ip.len - ip.ihl * 4 if IP in p else ip.plen
    return bytes(ip.payload)[:length]


def assert_sctp(frame: bytes) -> Ether:
    """The frame's IPv4 header checksum and its SCTP CRC are right."""
    p = assert_checksums(frame) if Ether(frame).type == 0x0800 else Ether(frame)
    raw = sctp_bytes(p)
    assert raw[8:12] == crc_of(raw), f"SCTP CRC {raw[8:12].hex()}, expected {crc_of(raw).hex()}"
    return p


def init(sport, dst=VIP, dport=PORT, client=POD, size=0, tag=0, chksum=None):
    """An INIT (tag 0) or, with `size`, a DATA chunk of that many bytes."""
    chunk = (SCTPChunkData(tsn=7, data=bytes(range(256)) * (size // 256) + bytes(range(size % 256)))
             if size else SCTPChunkInit(init_tag=0x1234abcd, a_rwnd=65535, n_out_streams=1, n_in_streams=1,
                                        init_tsn=7))
    ip = IP(src=client, dst=dst) if ":" not in dst else IPv6(src=client, dst=dst)
    return eth(ip / SCTP(sport=sport, dport=dport, tag=tag, chksum=chksum) / chunk)


def answer(p, sport, dport, dst):
    """The backend's INIT-ACK to a translated packet `p`."""
    ip = IP(src=p[IP].dst, dst=dst) if IP in p else IPv6(src=p[IPv6].dst, dst=dst)
    return eth(ip / SCTP(sport=sport, dport=dport, tag=0x1234abcd) /
               SCTPChunkInitAck(init_tag=0x5678, a_rwnd=65535, n_out_streams=1, n_in_streams=1, init_tsn=9))


@pytest.mark.parametrize("n", [12, 13, 100, 1480, 9000, 65535])
def test_the_loaders_table_turns_a_port_change_into_the_crc_change_scapy_computes(n):
    """loader/sctp.py's x^(8n): for an n-byte SCTP packet, the CRC after a port change is
    the CRC before it XOR d * x^(8n), d the XOR of the old and new ports (bpf/sctp.h)."""
    rnd = random.Random(n)
    before = bytes([rnd.randrange(256) for _ in range(8)]) + b"\0" * 4 + bytes(rnd.randrange(256) for _ in range(n - 12))
    after = struct.pack("!HH", 40000, 3868) + before[4:]
    d = struct.unpack("<I", bytes(a ^ b for a, b in zip(before[:4], after[:4])))[0]
    crc = lambda m: struct.unpack("<I", crc_of(m))[0]
    assert crc(after) == crc(before) ^ sctp.mulmod(sctp.crc_shift_table()[n], d)
    assert crc(after) != crc(before)


@pytest.mark.parametrize("size", [0, 1, 5, 255, 1024, 1400])
def test_a_new_association_is_translated_with_a_valid_crc(hook, table, size):
    """The ports change (99 -> 3868), so the CRC must follow, whatever the length."""
    sport = 40000 + size
    pkt = init(sport, size=size)
    verdict, out = hook.run(pkt)
    assert verdict == hook.translated
    p = assert_sctp(out)
    assert p[IP].dst in BACKEND_ADDRS and (p[IP].src, p[SCTP].sport, p[SCTP].dport) == (POD, sport, TARGET)
    assert bytes(p[SCTP])[4:8] == bytes(pkt[SCTP])[4:8]          # the verification tag
    assert bytes(p[SCTP])[12:] == bytes(pkt[SCTP])[12:]          # the chunks
    flows = [f for f in conntrack.get_flows(table.maps, V4, POD, sport, SCTP_PROTO) if f.front == (VIP, PORT)]
    assert len(flows) == 1 and flows[0].backend == (p[IP].dst, TARGET)


def test_the_backends_answer_is_translated_back_with_a_valid_crc(hook, table):
    p = Ether(hook.run(init(40100))[1])
    verdict, out = hook.run(answer(p, TARGET, 40100, POD))
    assert verdict == hook.translated
    r = assert_sctp(out)
    assert (r[IP].src, r[SCTP].sport, r[IP].dst, r[SCTP].dport) == (VIP, PORT, POD, 40100)
    # the association's next packet goes to the same backend
    again = assert_sctp(hook.run(init(40100, size=40, tag=0x5678))[1])
    assert again[IP].dst == p[IP].dst


def test_a_port_that_stays_leaves_the_crc_bytes_as_they_were(hook, table):
    pkt = init(40200, dport=SAME, size=100)
    verdict, out = hook.run(pkt)
    assert verdict == hook.translated
    p = assert_sctp(out)
    assert p[IP].dst in BACKEND_ADDRS and p[SCTP].dport == SAME
    assert bytes(p[SCTP])[8:12] == bytes(pkt[SCTP])[8:12]


def test_a_crc_the_sender_has_not_filled_in_stays_unfilled(hook, table):
    """A Linux socket's packet on a device with SCTP CRC offload (veth) carries 0 there
    until a device without the offload computes it over the whole packet: a delta added to
    it would make that computation wrong."""
    verdict, out = hook.run(init(40300, size=64, chksum=0))
    assert verdict == hook.translated
    p = Ether(out)
    assert p[SCTP].dport == TARGET and p[SCTP].chksum == 0


def test_an_outside_client_through_the_node_port_is_masqueraded_with_valid_crcs(hook, table):
    verdict, out = hook.run(init(40400, dst=NODE_IP, dport=NODE_PORT, client=OUTSIDE, size=200))
    assert verdict == hook.translated
    p = assert_sctp(out)
    assert (p[IP].src, p[SCTP].dport) == (NODE_IP, TARGET) and p[IP].dst in BACKEND_ADDRS
    assert C["SRC_PORT_MIN"] <= p[SCTP].sport <= C["SRC_PORT_MAX"]   # both ports changed
    verdict, out = hook.run(answer(p, TARGET, p[SCTP].sport, NODE_IP))
    assert verdict == hook.translated
    r = assert_sctp(out)
    assert (r[IP].src, r[SCTP].sport, r[IP].dst, r[SCTP].dport) == (NODE_IP, NODE_PORT, OUTSIDE, 40400)


def test_a_fragmented_datagram_is_dropped_when_its_ports_change_and_translated_when_not(hook, table):
    """The CRC change needs the datagram's length, which its first fragment does not say:
    refused rather than sent on with a CRC the backend would drop silently."""
    first = fragment(init(40500, size=1800)[IP], fragsize=1000)[0]
    assert hook.run(eth(first))[0] == hook.dropped
    first = fragment(init(40501, dport=SAME, size=1800)[IP], fragsize=1000)[0]
    verdict, out = hook.run(eth(first))
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert p[IP].dst in BACKEND_ADDRS and bytes(p[IP].payload)[:12] == bytes(first.payload)[:12]


def test_no_endpoints_rejects_and_an_sctp_only_cluster_ip_rejects_other_protocols(hook, table):
    """kube-proxy's reject for a Service without endpoints, and for a cluster IP's port
    that no Service defines (kxlb 0.2 dropped all of an SCTP-only Service's traffic)."""
    for pkt in (init(40600, dst=EMPTY_VIP), eth(IP(src=POD, dst=VIP) / TCP(sport=40601, dport=PORT, flags="S"))):
        verdict, out = hook.run(pkt)
        assert verdict == hook.sent_back
        r = Ether(out)
        assert (r[IP].src, r[IP].dst, r[ICMP].type, r[ICMP].code) == (pkt[IP].dst, POD, 3, 3)


def test_an_icmp_error_about_an_association_is_translated_for_the_client(hook, table):
    """The backend's "port unreachable" quotes the packet it got (POD -> backend:3868); the
    client is shown the packet it sent (POD -> VIP:99), its ports where it can match them."""
    p = Ether(hook.run(init(40700))[1])
    quote = bytes(p[IP])[:48]
    err = eth(IP(src=p[IP].dst, dst=POD) / ICMP(type=3, code=3) / quote)
    verdict, out = hook.run(err)
    assert verdict == hook.translated
    e = assert_checksums(out)
    q = e[IPerror]
    assert (e[IP].src, q.src, q.dst) == (VIP, POD, VIP)
    assert struct.unpack("!HH", bytes(q.payload)[:4]) == (40700, PORT)
    assert bytes(q.payload)[4:12] == bytes(p[SCTP])[4:12]   # the tag, and the CRC as quoted


def test_ipv6_associations_are_translated_both_ways_with_valid_crcs(hook, table):
    verdict, out = hook.run(init(40800, dst=VIP6, client=CLIENT6, size=333))
    assert verdict == hook.translated
    p = assert_sctp(out)
    assert (p[IPv6].src, p[IPv6].dst, p[SCTP].sport, p[SCTP].dport) == (CLIENT6, BACKEND6, 40800, TARGET)
    assert len(conntrack.get_flows(table.maps, V6, CLIENT6, 40800, SCTP_PROTO)) == 1
    verdict, out = hook.run(answer(p, TARGET, 40800, CLIENT6))
    assert verdict == hook.translated
    r = assert_sctp(out)
    assert (r[IPv6].src, r[SCTP].sport, r[IPv6].dst, r[SCTP].dport) == (VIP6, PORT, CLIENT6, 40800)
