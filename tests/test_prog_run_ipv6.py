"""The IPv6 datapath, run in the kernel with BPF_PROG_TEST_RUN on frames built by scapy.

The IPv6 journey is the IPv4 one instantiated for 16-byte addresses (bpf/flow.tmpl.h)
with its own parsing (extension headers, the fragment header), rewrites (no header
checksum: the L4 and ICMPv6 checksums cover the addresses) and reject (ICMPv6). Services
are programmed through loader/services.py's ServiceTable, as the controller and `kxlb
service` program them, into the IPv6 maps. Every case runs on both hooks and asserts on
the output frame's bytes and checksums, the verdict, and the maps.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import (ICMPv6DestUnreach, ICMPv6EchoRequest, ICMPv6ND_NS, ICMPv6PacketTooBig, IPerror6,
                                IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrFragment, IPv6ExtHdrHopByHop, IPv6ExtHdrRouting,
                                TCPerror, UDPerror, fragment6)
from scapy.layers.l2 import Ether

from harness import CLIENT_MAC, NODE_MAC, clean_table, eth
from kxlb.loader import conntrack
from kxlb.loader.services import DatapathConfig, ServiceTable
from kxlb.loader.layout import V6, C, Backend, CtKey6, ServiceKey, c_to_ip6, ip6_to_c, port_to_raw
from kxlb.loader.svcspec import Frontend, Kind, LbService

CLIENT = "fd00:10::2"
VIP, PORT = "fd00:96::10", 80
BACKEND, BPORT = "fd00:1::11", 8080
EMPTY_VIP = "fd00:96::20"      # a service without endpoints
SVC_CIDR = "fd00:96::/112"
NODE6 = "fd00:10::1"
TC_MIN_FRAME6 = 14 + 40  # shortest IPv6 frame the skb test run accepts
CONFIG = DatapathConfig(service_cidrs=("10.96.0.0/16", SVC_CIDR))


@pytest.fixture
def table(dp):
    """TCP and UDP VIP:80 -> BACKEND:8080, and EMPTY_VIP:80 without endpoints, in the
    service CIDR; every map emptied afterwards."""
    with clean_table(dp[1]) as t:
        for proto in (6, 17):
            t.put(LbService.simple(ServiceKey(VIP, PORT, proto), [Backend(BACKEND, BPORT)]))
        t.put(LbService.simple(ServiceKey(EMPTY_VIP, PORT, 6), []))
        t.set_config(CONFIG)
        yield t


@pytest.fixture
def maps(table):
    return table.maps


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
    key = CtKey6(addr=ip6_to_c(CLIENT), port=port_to_raw(40000), proto=6)   # the client socket's record
    rec = maps.conntrack6.get(key)
    assert rec is not None and c_to_ip6(rec.flow[0].backend_addr) == BACKEND
    assert rec.flow[0].svc_id == ServiceTable(maps).read_all()[ServiceKey(VIP, PORT, 6)].svc_id
    # user space reads the flow as the datapath wrote it (loader/conntrack.py), and shows
    # IPv6 endpoints bracketed
    flow, = conntrack.get_flows(maps, V6, CLIENT, 40000, 6)
    assert (str(flow.client), str(flow.front), str(flow.backend)) == (f"[{CLIENT}]:40000", f"[{VIP}]:{PORT}",
                                                                      f"[{BACKEND}]:{BPORT}")
    assert conntrack.delete_flow(maps, flow) and maps.conntrack6.get(key) is None


def test_reply_is_reverse_nated_to_the_vip(hook, maps):
    hook.run(fwd(sport=40001))
    reply = eth(IPv6(src=BACKEND, dst=CLIENT) / TCP(sport=BPORT, dport=40001, flags="SA") / b"world")
    verdict, out = hook.run(reply)
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport) == (VIP, PORT)
    assert (p[IPv6].dst, p[TCP].dport) == (CLIENT, 40001)


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_a_checksum_complete_skb_keeps_a_true_sum(complete, table, proto):
    """IPv6 NAT at tc on a NIC that sums every packet: the kernel's L4 checksum helper,
    told of an address change, adjusts a CHECKSUM_COMPLETE sum as IPv4 needs it (whose
    header checksum compensates the change; IPv6 has none), so the sum ended off by the
    address change. Both ways, an ICMPv6 error about the flow, and a masqueraded flow."""
    sport = 40010 if proto is TCP else 5360
    verdict, out = complete.run(fwd(sport=sport, proto=proto))
    assert verdict == complete.translated and (Ether(out)[IPv6].dst, Ether(out)[proto].dport) == (BACKEND, BPORT)
    verdict, out = complete.run(eth(IPv6(src=BACKEND, dst=CLIENT) / proto(sport=BPORT, dport=sport) / b"world"))
    assert verdict == complete.translated and (Ether(out)[IPv6].src, Ether(out)[proto].sport) == (VIP, PORT)
    err = eth(IPv6(src=CLIENT, dst=VIP) / ICMPv6DestUnreach(code=4) / bytes(Ether(out)[IPv6]))
    verdict, out = complete.run(err)
    assert verdict == complete.translated and Ether(out)[IPv6].dst == BACKEND
    table.set_config(DatapathConfig(snat_addrs=("10.0.0.1", NODE6), cluster_cidrs=("10.0.0.0/16", "fd00::/16"),
                                    service_cidrs=CONFIG.service_cidrs))
    verdict, out = complete.run(eth(IPv6(src=BACKEND, dst=VIP) / proto(sport=45010, dport=PORT) / b"h"))
    p = assert_checksums6(out)
    assert verdict == complete.translated and (p[IPv6].src, p[IPv6].dst) == (NODE6, BACKEND)
    reply = eth(IPv6(src=BACKEND, dst=NODE6) / proto(sport=BPORT, dport=p[proto].sport) / b"r")
    verdict, out = complete.run(reply)
    assert verdict == complete.translated and (Ether(out)[IPv6].src, Ether(out)[proto].dport) == (VIP, 45010)


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


def test_more_ipv6_service_cidrs_than_the_config_holds_are_each_dropped_or_rejected(hook, table):
    """As for IPv4 (test_prog_run_service_types.py): the fifth and later CIDRs of the
    family live in its source range map under service id 0."""
    extra = tuple(f"fd00:{0x200 + i:x}::/112" for i in range(4))   # 5 IPv6 CIDRs: the last past the config's 4
    table.set_config(replace(CONFIG, service_cidrs=CONFIG.service_cidrs + extra))
    assert len(list(table.maps.src_ranges6.keys())) == 5 and not list(table.maps.src_ranges.keys())
    table.put(LbService.simple(ServiceKey("fd00:203::20", PORT, 6), [Backend(BACKEND, BPORT)]))
    verdict, _ = hook.run(fwd(sport=40011, dst="fd00:203::99"))
    assert verdict == hook.dropped
    verdict, out = hook.run(fwd(sport=40011, dst="fd00:203::20", dport=81))
    assert verdict == hook.sent_back and Ether(out)[ICMPv6DestUnreach].code == 4
    verdict, out = hook.run(fwd(sport=40011, dst="fd00:204::99"))
    assert verdict == hook.passed and Ether(out)[IPv6].dst == "fd00:204::99"
    table.set_config(CONFIG)
    assert not list(table.maps.src_ranges6.keys())
    verdict, _ = hook.run(fwd(sport=40012, dst="fd00:203::99"))
    assert verdict == hook.passed


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


def test_hairpin_is_masqueraded_both_ways(hook, table):
    """The shared decision (lb.tmpl.h) for IPv6: a backend reaching itself through the VIP
    is masqueraded to the node's address, from the range of masquerade ports."""
    node = NODE6
    table.set_config(DatapathConfig(snat_addrs=("10.0.0.1", node), cluster_cidrs=("10.0.0.0/16", "fd00::/16"),
                                    service_cidrs=CONFIG.service_cidrs))
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


# --- features through the service model (loader/services.py writes the IPv6 maps) ----

def backends6(n: int, port: int = BPORT) -> tuple[Backend, ...]:
    return tuple(Backend(f"fd00:1::{i + 1:x}", port) for i in range(n))


def test_the_table_reads_back_what_it_wrote_for_both_families(table):
    """Every field of an IPv6 service port round-trips through the maps, beside an
    IPv4 one: a restarted controller adopts both families."""
    spec6 = LbService(key=ServiceKey("fd00:96::30", 443, 6), cluster=backends6(20), local=backends6(2),
                      frontends=(Frontend(ServiceKey(NODE6, 30443, 6), Kind.NODE_PORT),
                                 Frontend(ServiceKey("2001:db8::5", 443, 6), Kind.LOAD_BALANCER)),
                      external_local=True, has_endpoints=True, affinity_s=60,
                      source_ranges=("2001:db8:7::/48", "192.168.0.0/16"))
    spec4 = LbService.simple(ServiceKey("10.96.0.30", 443, 6), [Backend("10.1.0.1", 8443)])
    table.put(spec6)
    table.put(spec4)
    got = ServiceTable(table.maps).read_all()
    assert got[spec6.key].spec == spec6.canonical() and got[spec4.key].spec == spec4
    assert got[spec6.key].spec.source_ranges == ("2001:db8:7::/48",)   # the IPv4 range is the IPv4 port's
    assert got[spec6.key].svc_id != got[spec4.key].svc_id              # one id space: shared Maglev map
    assert table.read_config() == CONFIG


def test_maglev_spreads_ipv6_flows_and_a_set_change_keeps_most(hook, table):
    """More than one backend: the Maglev table of the IPv6 set (backend identities of 18
    bytes) decides, and one backend more moves few flows."""
    key = ServiceKey("fd00:96::40", PORT, 17)
    table.put(LbService.simple(key, backends6(4)))

    def picks(n: int) -> list[str]:
        out = []
        for i in range(n):
            verdict, frame = hook.run(fwd(b"q", sport=20000 + i, dst=key.vip, proto=UDP))
            assert verdict == hook.translated
            out.append(assert_checksums6(frame)[IPv6].dst)
        return out

    before = picks(200)
    assert set(before) == {b.addr for b in backends6(4)}
    for k in list(table.maps.conntrack6.keys()):
        table.maps.conntrack6.delete(k)
    table.set_backends(key, backends6(5))
    after = picks(200)
    moved = sum(a != b for a, b in zip(before, after))
    assert 0 < moved < 200 * 0.4, f"{moved} of 200 flows moved for one backend more"


def node_port6(table, cip: str, node_port: int, backend: Backend) -> None:
    """A NodePort service on NODE6 with one backend, the node masquerading to NODE6."""
    table.put(LbService(key=ServiceKey(cip, PORT, 6), cluster=(backend,), has_endpoints=True,
                        frontends=(Frontend(ServiceKey(NODE6, node_port, 6), Kind.NODE_PORT),)))
    table.set_config(DatapathConfig(snat_addrs=("10.0.0.1", NODE6), cluster_cidrs=("fd00:10::/32",),
                                    service_cidrs=CONFIG.service_cidrs))


def test_an_ipv6_node_port_from_outside_is_masqueraded_to_the_nodes_ipv6_address(hook, table):
    node_port6(table, "fd00:96::50", 30080, Backend(BACKEND, BPORT))
    outside = "2001:db8:99::7"
    verdict, out = hook.run(eth(IPv6(src=outside, dst=NODE6) / TCP(sport=41000, dport=30080, flags="S")))
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[IPv6].dst, p[TCP].dport) == (NODE6, BACKEND, BPORT)
    verdict, out = hook.run(eth(IPv6(src=BACKEND, dst=NODE6) / TCP(sport=BPORT, dport=p[TCP].sport, flags="SA")))
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport, p[IPv6].dst, p[TCP].dport) == (NODE6, 30080, outside, 41000)


def test_an_ipv6_host_network_endpoint_of_this_node_answers_through_egress(hook, table, egress):
    """The node's own IPv6 address as an endpoint: not masqueraded, and the reply its
    stack sends is translated at tc egress (IPv4: test_prog_run_service_types.py)."""
    node_port6(table, "fd00:96::51", 30081, Backend(NODE6, 18080))
    outside = "2001:db8:99::8"
    verdict, out = hook.run(eth(IPv6(src=outside, dst=NODE6) / TCP(sport=41001, dport=30081, flags="S")))
    assert verdict == hook.translated
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport, p[IPv6].dst, p[TCP].dport) == (outside, 41001, NODE6, 18080)
    verdict, out = egress.run(eth(IPv6(src=NODE6, dst=outside) / TCP(sport=18080, dport=41001, flags="SA")))
    assert verdict == 0
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[TCP].sport, p[IPv6].dst, p[TCP].dport) == (NODE6, 30081, outside, 41001)
    frame = eth(IPv6(src=NODE6, dst=outside) / TCP(sport=22, dport=41001, flags="A"))
    assert egress.run(frame) == (-1, bytes(frame))  # the node's other traffic: untouched


def test_ipv6_source_ranges_admit_only_their_clients(hook, table):
    lb = "2001:db8::80"
    table.put(LbService(key=ServiceKey("fd00:96::60", PORT, 6), cluster=(Backend(BACKEND, BPORT),),
                        has_endpoints=True, frontends=(Frontend(ServiceKey(lb, PORT, 6), Kind.LOAD_BALANCER),),
                        source_ranges=("2001:db8:aa::/48",)))
    inside = eth(IPv6(src="2001:db8:aa:1::9", dst=lb) / TCP(sport=42000, dport=PORT, flags="S"))
    outside = eth(IPv6(src="2001:db8:bb::9", dst=lb) / TCP(sport=42001, dport=PORT, flags="S"))
    verdict, out = hook.run(inside)
    assert verdict == hook.translated and Ether(out)[IPv6].dst == BACKEND
    verdict, _ = hook.run(outside)
    assert verdict == hook.dropped


def test_ipv6_session_affinity_keeps_a_client_on_its_backend(hook, table):
    key = ServiceKey("fd00:96::70", PORT, 6)
    table.put(LbService(key=key, cluster=backends6(8), has_endpoints=True, affinity_s=300))
    dsts = set()
    for sport in range(43000, 43030):
        verdict, out = hook.run(fwd(sport=sport, dst=key.vip))
        assert verdict == hook.translated
        dsts.add(Ether(out)[IPv6].dst)
    assert len(dsts) == 1
    (entry,) = [v for k, v in table.maps.affinity6.items()]
    assert c_to_ip6(entry.addr) in dsts
