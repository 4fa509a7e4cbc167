"""The IPv6 datapath, run in the kernel with BPF_PROG_TEST_RUN on frames built by scapy.

The IPv6 journey is the IPv4 one instantiated for 16-byte addresses (bpf/flow.tmpl.h)
with its own parsing (extension headers, the fragment header), rewrites (no header
checksum: the L4 and ICMPv6 checksums cover the addresses) and reject (ICMPv6). Services
are written straight into the IPv6 maps here, through their ctypes mirrors: the
controller and `kxlb service` do not program IPv6 services yet. Every case runs on both
hooks and asserts on the output frame's bytes and checksums, the verdict, and the maps.
"""
from __future__ import annotations

import ctypes
import ipaddress

import pytest
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import (ICMPv6DestUnreach, ICMPv6EchoRequest, ICMPv6ND_NS, ICMPv6PacketTooBig, IPerror6,
                                IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, IPv6ExtHdrHopByHop, IPv6ExtHdrRouting,
                                TCPerror, UDPerror, fragment6)
from scapy.layers.l2 import Ether

from harness import CLIENT_MAC, NODE_MAC, clean_table, eth
from kxlb.loader.services import ServiceTable
from kxlb.loader.layout import (C, BackendKey, BackendValue6, CtKey6, LbConfig6, SvcKey6, SvcValue, c_to_ip6,
                                ip6_to_c, port_to_raw)

CLIENT = "fd00:10::2"
VIP, PORT = "fd00:96::10", 80
BACKEND, BPORT = "fd00:1::11", 8080
EMPTY_VIP = "fd00:96::20"      # a service without endpoints
SVC_CIDR, SVC_PREFIX = "fd00:96::", 112
SVC_ID, EMPTY_ID = 7001, 7002
TC_MIN_FRAME6 = 14 + 40  # shortest IPv6 frame the skb test run accepts


def put_service6(maps, vip, port, proto, svc_id, backends):
    """One IPv6 service port as the loader lays it out (maps.h): backend slots of
    generation 0 first, then the frontend. One backend at most: no Maglev table."""
    assert len(backends) <= 1
    for slot, (addr, bport) in enumerate(backends):
        maps.backends6.put(BackendKey(svc_id=svc_id, slot=slot, gen=0, set=C["SET_CLUSTER"]),
                           BackendValue6(addr=ip6_to_c(addr), port=port_to_raw(bport)))
    flags = C["SVC_F_HAS_ENDPOINTS"] if backends else 0
    maps.services6.put(SvcKey6(vip=ip6_to_c(vip), port=port_to_raw(port), proto=proto),
                       SvcValue(svc_id=svc_id, count=len(backends), kind=C["KIND_CLUSTER_IP"], flags=flags))
    maps.services6.put(SvcKey6(vip=ip6_to_c(vip)), SvcValue(kind=C["KIND_MARKER"]))  # a live cluster IP


def mask6(prefix: int):
    return ip6_to_c(str(ipaddress.IPv6Network(f"::/{prefix}").netmask))


@pytest.fixture
def maps(dp):
    """TCP and UDP VIP:80 -> BACKEND:8080, and EMPTY_VIP:80 without endpoints, in the
    service CIDR; every map emptied afterwards."""
    with clean_table(dp[1]) as t:
        m = t.maps
        for proto in (6, 17):
            put_service6(m, VIP, PORT, proto, SVC_ID + proto, [(BACKEND, BPORT)])
        put_service6(m, EMPTY_VIP, PORT, 6, EMPTY_ID, [])
        cfg = LbConfig6()
        cfg.svc_cidr[0], cfg.svc_mask[0] = ip6_to_c(SVC_CIDR), mask6(SVC_PREFIX)
        m.config6.put(ctypes.c_uint32(0), cfg)
        try:
            yield m
        finally:
            m.config6.put(ctypes.c_uint32(0), LbConfig6())


def counters(maps) -> dict[str, int]:
    return ServiceTable(maps).datapath_counters()


def fwd(payload=b"hello", sport=40000, dport=PORT, dst=VIP, ext=(), proto=TCP, **kw):
    l4 = proto(sport=sport, dport=dport, **({"flags": "S", "seq": 1000} if proto is TCP else {}), **kw)
    ip = IPv6(src=CLIENT, dst=dst)
    for h in ext:
        ip = ip / h
    return eth(ip / l4 / payload)


CHECKED = (TCP, UDP, ICMPv6DestUnreach, ICMPv6PacketTooBig)


def _sum_field(layer) -> str:
    return "cksum" if "cksum" in layer.fields else "chksum"


def assert_checksums6(frame: bytes) -> Ether:
    """Parse ``frame``; its TCP/UDP/ICMPv6 checksums (not those inside an ICMPv6 error's
    quote) must be what scapy computes, and a UDP checksum never 0 (IPv6 forbids it)."""
    p = Ether(frame)
    rebuilt = p.copy()
    for layer in CHECKED:
        if layer in rebuilt:
            delattr(rebuilt[layer], _sum_field(rebuilt[layer]))
    rebuilt = Ether(bytes(rebuilt))
    for layer in CHECKED:
        if layer in p:
            field = _sum_field(p[layer])
            got, want = getattr(p[layer], field), getattr(rebuilt[layer], field)
            assert got == want, f"{layer.__name__} checksum {got:#x}, expected {want:#x}"
            if layer is UDP:
                assert got != 0
    return p


def test_new_tcp_flow_is_dnated_and_tracked(hook, maps):
    verdict, out = hook.run(fwd())
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport) == (CLIENT, 40000)
    assert (p[IPv6].dst, p[TCP].dport) == (BACKEND, BPORT)
    assert bytes(p[TCP].payload) == b"hello"
    key = CtKey6(saddr=ip6_to_c(CLIENT), daddr=ip6_to_c(VIP), sport=port_to_raw(40000), dport=port_to_raw(PORT),
                 proto=6, dir=C["CT_DIR_FWD"])
    e = maps.conntrack6.get(key)
    assert e is not None and c_to_ip6(e.backend_addr) == BACKEND and e.svc_id == SVC_ID + 6


def test_reply_is_reverse_nated_to_the_vip(hook, maps):
    hook.run(fwd(sport=40001))
    reply = eth(IPv6(src=BACKEND, dst=CLIENT) / TCP(sport=BPORT, dport=40001, flags="SA") / b"world")
    verdict, out = hook.run(reply)
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport) == (VIP, PORT)
    assert (p[IPv6].dst, p[TCP].dport) == (CLIENT, 40001)


@pytest.mark.parametrize("payload", [b"x", b"\x00" * 7, bytes(range(256)) * 4])
def test_udp_both_ways_with_valid_nonzero_checksums(hook, maps, payload):
    verdict, out = hook.run(fwd(payload, sport=5353, proto=UDP))
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].dst, p[UDP].dport) == (BACKEND, BPORT) and bytes(p[UDP].payload) == payload
    verdict, out = hook.run(eth(IPv6(src=BACKEND, dst=CLIENT) / UDP(sport=BPORT, dport=5353) / payload))
    p = assert_checksums6(out)
    assert verdict == hook.translated and (p[IPv6].src, p[UDP].sport) == (VIP, PORT)


def test_extension_headers_are_walked_and_kept(hook, maps):
    ext = (IPv6ExtHdrHopByHop(), IPv6ExtHdrDestOpt())
    verdict, out = hook.run(fwd(sport=40002, ext=ext))
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert IPv6ExtHdrHopByHop in p and IPv6ExtHdrDestOpt in p
    assert (p[IPv6].dst, p[TCP].dport) == (BACKEND, BPORT)


def test_a_packet_still_being_source_routed_is_not_ours(hook, maps):
    frame = fwd(sport=40003, ext=(IPv6ExtHdrRouting(addresses=["fd00:99::1"], segleft=1),))
    verdict, out = hook.run(frame)
    assert verdict == hook.passed and out == bytes(frame)


def test_fragments_follow_the_first_fragment(hook, maps):
    payload = bytes(range(200)) * 6
    whole = IPv6(src=CLIENT, dst=VIP) / IPv6ExtHdrFragment(id=0x1234) / UDP(sport=6000, dport=PORT) / payload
    frags = [eth(f) for f in fragment6(whole, 600)]
    assert len(frags) >= 2
    outs = [hook.run(f) for f in frags]
    assert all(v == hook.translated for v, _ in outs)
    first = Ether(outs[0][1])
    assert (first[IPv6].dst, first[UDP].dport) == (BACKEND, BPORT)
    for _, later in outs[1:]:
        p = Ether(later)
        assert p[IPv6].dst == BACKEND and p[IPv6ExtHdrFragment].offset > 0
    # Reassembled, the datagram's checksum holds over the whole payload.
    data = b"".join(bytes(Ether(o)[IPv6ExtHdrFragment].payload) for _, o in outs)
    udp = UDP(data)
    rebuilt = IPv6(src=CLIENT, dst=BACKEND) / UDP(sport=6000, dport=BPORT) / payload
    assert udp.chksum == UDP(bytes(rebuilt[UDP])).chksum


def test_a_later_fragment_before_its_first_passes_untouched(hook, maps):
    frame = eth(IPv6(src=CLIENT, dst=VIP) / IPv6ExtHdrFragment(id=0x9999, offset=100, nh=17) / (b"z" * 64))
    verdict, out = hook.run(frame)
    assert verdict == hook.passed and out == bytes(frame)


@pytest.mark.parametrize("frame", [
    eth(IPv6(src="fe80::1", dst="ff02::1:ff00:10") / ICMPv6ND_NS(tgt=VIP)),
    eth(IPv6(src="fe80::1", dst=VIP) / ICMPv6ND_NS(tgt=VIP)),      # unicast neighbour probe of a VIP
    eth(IPv6(src=CLIENT, dst="fd00:77::1") / TCP(sport=1, dport=PORT)),  # no service there
], ids=["nd-multicast", "nd-unicast-to-vip", "no-service"])
def test_traffic_not_for_a_service_passes_untouched(hook, maps, frame):
    verdict, out = hook.run(frame)
    assert verdict == hook.passed and out == bytes(frame)


def test_service_without_endpoints_rejects_with_icmpv6_port_unreachable(hook, maps):
    frame = fwd(sport=40004, dst=EMPTY_VIP)
    verdict, out = hook.run(frame)
    assert verdict == hook.sent_back
    p = assert_checksums6(out)
    assert (p[Ether].src, p[Ether].dst) == (NODE_MAC, CLIENT_MAC)
    assert (p[IPv6].src, p[IPv6].dst) == (EMPTY_VIP, CLIENT)
    assert p[ICMPv6DestUnreach].code == 4  # port unreachable
    assert bytes(p[ICMPv6DestUnreach].payload)[:48] == bytes(frame)[14:14 + 48]


def test_other_port_of_a_cluster_ip_is_rejected_and_unallocated_address_dropped(hook, maps):
    verdict, out = hook.run(fwd(sport=40005, dport=81))
    assert verdict == hook.sent_back and Ether(out)[ICMPv6DestUnreach].code == 4
    verdict, _ = hook.run(fwd(sport=40005, dst="fd00:96::99"))
    assert verdict == hook.dropped


def test_echo_request_to_a_cluster_ip_is_rejected_like_ipv4(hook, maps):
    verdict, out = hook.run(eth(IPv6(src=CLIENT, dst=VIP) / ICMPv6EchoRequest(id=1, seq=1)))
    assert verdict == hook.sent_back and Ether(out)[ICMPv6DestUnreach].code == 4


def test_packet_too_big_from_the_backend_side_reaches_the_client_translated(hook, maps):
    """Path MTU discovery through a VIP: a router towards the backend says the client's
    translated packet was too big. The client must see its own packet quoted (to the
    VIP), or it cannot match the error to its socket."""
    _, out = hook.run(fwd(b"x" * 100, sport=40006))
    sent = Ether(out)[IPv6]
    router = "fd00:1::1"
    err = eth(IPv6(src=router, dst=CLIENT) / ICMPv6PacketTooBig(mtu=1280) / bytes(sent))
    verdict, out = hook.run(err)
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[IPv6].dst) == (router, CLIENT)  # a router's address is never rewritten
    q = p[IPerror6]
    assert (q.src, q.dst) == (CLIENT, VIP) and (q[TCPerror].sport, q[TCPerror].dport) == (40006, PORT)
    inner = IPv6(bytes(q))
    del inner[TCP].chksum
    assert IPv6(bytes(inner))[TCP].chksum == q[TCPerror].chksum  # the quoted checksum too


def test_port_unreachable_from_the_client_about_a_reply_goes_to_the_backend(hook, maps):
    hook.run(fwd(sport=5454, proto=UDP))
    _, reply = hook.run(eth(IPv6(src=BACKEND, dst=CLIENT) / UDP(sport=BPORT, dport=5454) / b"r"))
    err = eth(IPv6(src=CLIENT, dst=VIP) / ICMPv6DestUnreach(code=4) / bytes(Ether(reply)[IPv6]))
    verdict, out = hook.run(err)
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[IPv6].dst) == (CLIENT, BACKEND)
    q = p[IPerror6]
    assert (q.src, q.dst) == (BACKEND, CLIENT) and (q[UDPerror].sport, q[UDPerror].dport) == (BPORT, 5454)


def test_truncated_frames_are_never_rewritten(hook, maps):
    whole = bytes(fwd(sport=40007))
    before = counters(maps)["malformed"]
    # The skb test run refuses IPv6 frames shorter than the IPv6 header.
    cuts = [c for c in (14 + 20, 14 + 40, 14 + 40 + 10, 14 + 40 + 19) if hook.name == "xdp" or c >= TC_MIN_FRAME6]
    for cut in cuts:
        verdict, out = hook.run(whole[:cut])
        assert verdict == hook.passed and out == whole[:cut]
    assert counters(maps)["malformed"] - before == len(cuts)


def test_hairpin_is_masqueraded_both_ways(hook, maps):
    """The shared decision (lb.tmpl.h) for IPv6: a backend reaching itself through the VIP
    is masqueraded to the node's address, from the range of masquerade ports."""
    node = "fd00:10::1"
    cfg = maps.config6.get(ctypes.c_uint32(0))
    cfg.snat_addr = ip6_to_c(node)
    cfg.cluster_cidr, cfg.cluster_mask = ip6_to_c("fd00::"), mask6(16)
    maps.config6.put(ctypes.c_uint32(0), cfg)
    frame = eth(IPv6(src=BACKEND, dst=VIP) / TCP(sport=45000, dport=PORT, flags="S"))
    verdict, out = hook.run(frame)
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[IPv6].dst, p[TCP].dport) == (node, BACKEND, BPORT)
    assert C["SRC_PORT_MIN"] <= p[TCP].sport <= C["SRC_PORT_MAX"]
    reply = eth(IPv6(src=BACKEND, dst=node) / TCP(sport=BPORT, dport=p[TCP].sport, flags="SA"))
    verdict, out = hook.run(reply)
    p = assert_checksums6(out)
    assert verdict == hook.translated
    assert (p[IPv6].src, p[TCP].sport, p[IPv6].dst, p[TCP].dport) == (VIP, PORT, BACKEND, 45000)
