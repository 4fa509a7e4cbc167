"""The datapath, run in the kernel with BPF_PROG_TEST_RUN on frames built by scapy.

Every case runs on both hooks (tc and XDP) and asserts on the output frame's bytes and
checksums, the verdict, and map contents.
"""
from __future__ import annotations

import random

import pytest
from scapy.layers.inet import IPOption_NOP, fragment
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP

from harness import (CLIENT_MAC, ICMP, IP, NODE_MAC, TCP, UDP, Ether, IPerror, assert_checksums, clean_table, eth,
                     flips_done, start_flipper)
from kxlb.loader import conntrack
from kxlb.loader.layout import V4, C, Backend, ServiceKey
from kxlb.loader.services import DatapathConfig

CLIENT = "10.0.0.2"
VIP, PORT = "10.96.0.10", 80
BACKENDS = [Backend(f"10.1.0.{i}", 8080) for i in (11, 12, 13)]
BACKEND_ADDRS = {b.addr for b in BACKENDS}
TCP_SVC = ServiceKey(VIP, PORT, 6)
TC_MIN_FRAME = 14 + 20  # shortest IPv4 frame the skb test run accepts
UDP_SVC = ServiceKey(VIP, PORT, 17)


@pytest.fixture
def table(dp):
    """Services TCP and UDP VIP:80 -> three backends; all maps emptied afterwards."""
    with clean_table(dp[1]) as t:
        t.add(TCP_SVC, BACKENDS)
        t.add(UDP_SVC, BACKENDS)
        yield t


def syn(sport=40000, dst=VIP, dport=PORT, flags="S", client=CLIENT):
    return eth(IP(src=client, dst=dst) / TCP(sport=sport, dport=dport, flags=flags, seq=1000) / b"payload")


def ct_flow(maps, client, cport, front, fport, proto=6):
    """The flow of client:cport to frontend front:fport, read through loader/conntrack.py
    (one record per client socket, one way per frontend)."""
    got = [f for f in conntrack.get_flows(maps, V4, client, cport, proto) if f.front == (front, fport)]
    assert len(got) <= 1, got
    return got[0] if got else None


def ttl(flow) -> float:
    """Seconds the flow has left."""
    return flow.expires_in_s()


def test_new_tcp_flow_is_dnated_to_a_backend_and_tracked(hook, table):
    verdict, out = hook.run(syn())
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert p[IP].dst in BACKEND_ADDRS and p[TCP].dport == 8080
    assert (p[IP].src, p[TCP].sport) == (CLIENT, 40000)
    assert bytes(p[TCP].payload) == b"payload"
    flow = ct_flow(table.maps, CLIENT, 40000, VIP, PORT)
    assert flow is not None and flow.backend == (p[IP].dst, 8080) and flow.source_port == 40000
    assert C["CT_TCP_SYN_S"] - 5 < ttl(flow) <= C["CT_TCP_SYN_S"] + 2


def test_flow_keeps_its_backend_after_the_backend_set_changes(hook, table):
    first = Ether(hook.run(syn(sport=41000))[1])[IP].dst
    for _ in range(3):
        assert Ether(hook.run(syn(sport=41000, flags="A"))[1])[IP].dst == first
    remaining = [b for b in BACKENDS if b.addr != first]
    table.set_backends(TCP_SVC, remaining)
    verdict, out = hook.run(syn(sport=41000, flags="A"))
    assert verdict == hook.translated and Ether(out)[IP].dst == first  # pinned by conntrack
    new_dsts = {Ether(hook.run(syn(sport=42000 + i))[1])[IP].dst for i in range(60)}
    assert new_dsts == {b.addr for b in remaining}  # new flows avoid the removed one


def test_reply_is_reverse_nated_to_the_vip(hook, table):
    out = Ether(hook.run(syn(sport=40001))[1])
    backend = out[IP].dst
    reply = eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=40001, flags="SA", seq=5, ack=1001) / b"hi")
    verdict, out = hook.run(reply)
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert (p[IP].src, p[TCP].sport, p[IP].dst, p[TCP].dport) == (VIP, PORT, CLIENT, 40001)
    flow = ct_flow(table.maps, CLIENT, 40001, VIP, PORT)
    assert flow.flags & C["CT_F_REPLIED"]
    assert ttl(flow) <= C["CT_TCP_SYN_S"] + 2  # SYN, SYN-ACK: the handshake is not done
    hook.run(syn(sport=40001, flags="A"))
    assert ttl(ct_flow(table.maps, CLIENT, 40001, VIP, PORT)) <= C["CT_TCP_SYN_S"] + 2
    hook.run(eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=40001, flags="A", seq=6, ack=1001) / b"more"))
    assert ttl(ct_flow(table.maps, CLIENT, 40001, VIP, PORT)) > C["CT_TCP_EST_S"] - 5  # established both ways


def handshake(hook, sport):
    """A flow through the VIP with its handshake done both ways; returns its backend."""
    backend = Ether(hook.run(syn(sport=sport))[1])[IP].dst
    hook.run(eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=sport, flags="SA")))
    hook.run(syn(sport=sport, flags="A"))
    hook.run(eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=sport, flags="A") / b"data"))
    return backend


def test_half_open_flows_live_a_minute_not_six_hours(hook, table):
    """SYN and SYN-ACK with no ACK (a spoofed SYN): the backend answered, but the flow is
    not established (kxlb 0.2 kept it 6 hours)."""
    backend = Ether(hook.run(syn(sport=40010))[1])[IP].dst
    hook.run(eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=40010, flags="SA")))
    assert ttl(ct_flow(table.maps, CLIENT, 40010, VIP, PORT)) <= C["CT_TCP_SYN_S"] + 2
    handshake(hook, 40011)
    assert ttl(ct_flow(table.maps, CLIENT, 40011, VIP, PORT)) > C["CT_TCP_EST_S"] - 5


def test_rst_shortens_the_flow_lifetime(hook, table):
    handshake(hook, 40002)
    hook.run(syn(sport=40002, flags="R"))
    assert ttl(ct_flow(table.maps, CLIENT, 40002, VIP, PORT)) <= C["CT_TCP_CLOSE_S"] + 2


def test_fin_from_both_sides_closes_but_half_close_does_not(hook, table):
    backend = handshake(hook, 40003)
    hook.run(syn(sport=40003, flags="FA"))
    assert ttl(ct_flow(table.maps, CLIENT, 40003, VIP, PORT)) > C["CT_TCP_EST_S"] - 5  # half-closed: still open
    hook.run(eth(IP(src=backend, dst=CLIENT) / TCP(sport=8080, dport=40003, flags="FA")))
    assert ttl(ct_flow(table.maps, CLIENT, 40003, VIP, PORT)) <= C["CT_TCP_CLOSE_S"] + 2


def test_syn_reusing_a_closed_flow_picks_a_backend_again(hook, table):
    hook.run(syn(sport=40004))
    hook.run(syn(sport=40004, flags="R"))
    table.set_backends(TCP_SVC, BACKENDS[:1])
    out = Ether(hook.run(syn(sport=40004))[1])
    assert out[IP].dst == BACKENDS[0].addr


@pytest.mark.parametrize("csum", ["zero", "set"])
def test_udp_checksum(hook, table, csum):
    pkt = eth(IP(src=CLIENT, dst=VIP) / UDP(sport=5353, dport=PORT) / b"query")
    if csum == "zero":
        pkt[UDP].chksum = 0
    verdict, out = hook.run(pkt)
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert p[IP].dst in BACKEND_ADDRS and p[UDP].dport == 8080
    if csum == "zero":
        assert p[UDP].chksum == 0


def test_ip_options_are_kept_and_checksums_right(hook, table):
    pkt = eth(IP(src=CLIENT, dst=VIP, options=[IPOption_NOP()] * 8) / TCP(sport=40005, dport=PORT, flags="S"))
    assert pkt[IP].ihl is None or True
    verdict, out = hook.run(pkt)
    p = assert_checksums(out)
    assert p[IP].ihl == 7 and len(p[IP].options) == 8
    assert p[IP].dst in BACKEND_ADDRS and p[TCP].dport == 8080


def test_fragments_follow_the_first_fragment(hook, table):
    datagram = IP(src=CLIENT, dst=VIP, id=4242) / UDP(sport=6000, dport=PORT) / (b"x" * 2500)
    frags = fragment(datagram, fragsize=1000)
    assert len(frags) == 3
    outs = []
    for f in frags:
        verdict, out = hook.run(eth(f))
        assert verdict == hook.translated
        outs.append(Ether(out)[IP])
    backend = outs[0].dst
    assert backend in BACKEND_ADDRS and all(o.dst == backend for o in outs)
    for o in outs:  # header checksum of every fragment
        fixed = o.copy()
        del fixed.chksum
        assert IP(bytes(fixed)).chksum == o.chksum
    # Reassembled, the datagram has the backend's port and a valid UDP checksum.
    whole = IP(src=CLIENT, dst=backend) / UDP(bytes(b"".join(bytes(o.payload) for o in outs)))
    assert whole[UDP].dport == 8080
    check = whole[UDP].chksum
    del whole[UDP].chksum
    assert IP(bytes(whole))[UDP].chksum == check


def test_a_fragment_before_its_first_passes_untouched(hook, table):
    frag = eth(IP(src=CLIENT, dst=VIP, id=999, frag=125, proto=17) / (b"y" * 100))
    raw = bytes(frag)
    verdict, out = hook.run(raw)
    assert verdict == hook.passed and out == raw


def test_icmp_port_unreachable_from_a_backend_is_translated(hook, table):
    out = Ether(hook.run(eth(IP(src=CLIENT, dst=VIP) / UDP(sport=6001, dport=PORT) / b"q"))[1])
    backend = out[IP].dst
    quoted = bytes(out[IP])[:28]  # what the backend's kernel quotes: IP header + 8 bytes
    err = eth(IP(src=backend, dst=CLIENT) / ICMP(type=3, code=3) / quoted)
    verdict, out = hook.run(err)
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert p[IP].src == VIP and p[IP].dst == CLIENT
    assert (p[IPerror].src, p[IPerror].dst) == (CLIENT, VIP)
    assert p[IPerror].payload.sport == 6001 and p[IPerror].payload.dport == PORT


def test_icmp_error_from_the_client_about_a_reply_goes_to_the_backend(hook, table):
    out = Ether(hook.run(eth(IP(src=CLIENT, dst=VIP) / UDP(sport=6002, dport=PORT) / b"q"))[1])
    backend = out[IP].dst
    reply = Ether(hook.run(eth(IP(src=backend, dst=CLIENT) / UDP(sport=8080, dport=6002) / b"r"))[1])
    err = eth(IP(src=CLIENT, dst=VIP) / ICMP(type=3, code=3) / bytes(reply[IP])[:28])
    verdict, out = hook.run(err)
    p = assert_checksums(out)
    assert p[IP].dst == backend
    assert (p[IPerror].src, p[IPerror].payload.sport) == (backend, 8080)


@pytest.mark.parametrize("frame", [
    eth(IP(src=CLIENT, dst="10.96.0.99") / TCP(sport=1, dport=PORT, flags="S")),   # other address
    eth(IP(src=CLIENT, dst=VIP) / TCP(sport=1, dport=81, flags="S")),             # other port
    eth(IP(src=CLIENT, dst=VIP) / ICMP(type=8)),                                   # ping
    eth(IP(src=CLIENT, dst=VIP, proto=47) / b"gre"),                               # other protocol
    eth(ARP(pdst=VIP)),
    eth(IPv6(dst="fd00::1") / UDP(dport=PORT)),
], ids=["other-ip", "other-port", "icmp-echo", "gre", "arp", "ipv6"])
def test_traffic_not_for_a_service_passes_untouched(hook, table, frame):
    raw = bytes(frame)
    verdict, out = hook.run(raw)
    assert verdict == hook.passed and out == raw


def test_truncated_frames_are_never_rewritten(hook, table):
    raw = bytes(syn(sport=40100))
    # The kernel's skb test run refuses IPv4 frames shorter than an IP header; XDP takes
    # them, and the parser that judges them is the same code for both hooks.
    for cut in range(TC_MIN_FRAME if hook.name == "tc" else 14, len(raw)):
        verdict, out = hook.run(raw[:cut])
        assert verdict == hook.passed and out == raw[:cut], f"cut at {cut}"
    assert not list(table.maps.conntrack.keys())  # and nothing was tracked


def test_inconsistent_headers_are_never_rewritten(hook, table):
    good = syn(sport=40101)
    for mutate in (lambda p: setattr(p[IP], "len", 2000),      # claims more than arrived
                   lambda p: setattr(p[IP], "ihl", 4),          # header shorter than 20 bytes
                   lambda p: setattr(p[IP], "ihl", 15),         # options past the end
                   lambda p: setattr(p[IP], "version", 6),
                   lambda p: setattr(p[TCP], "dataofs", 2)):
        p = good.copy()
        mutate(p)
        raw = bytes(p)
        verdict, out = hook.run(raw)
        assert verdict == hook.passed and out == raw


def test_garbage_is_never_rewritten(hook, table):
    rnd = random.Random(7)
    for _ in range(300):
        body = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(TC_MIN_FRAME - 14 if hook.name == "tc" else 1, 120)))
        raw = bytes.fromhex("020000000002020000000001") + b"\x08\x00" + body
        verdict, out = hook.run(raw)
        assert verdict == hook.passed and out == raw


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_service_without_endpoints_rejects_with_port_unreachable(hook, table, proto):
    """kube-proxy's reject: ICMP port unreachable from the VIP, back where it came from."""
    table.set_backends(TCP_SVC if proto == "tcp" else UDP_SVC, [])
    pkt = syn(sport=40200) if proto == "tcp" else eth(IP(src=CLIENT, dst=VIP) / UDP(sport=40200, dport=PORT) / b"q")
    verdict, out = hook.run(pkt)
    assert verdict == hook.sent_back
    p = assert_checksums(out)
    assert (p.src, p.dst) == (NODE_MAC, CLIENT_MAC)
    assert (p[IP].src, p[IP].dst, p[ICMP].type, p[ICMP].code) == (VIP, CLIENT, 3, 3)
    assert bytes(p[IPerror])[:28] == bytes(pkt[IP])[:28]  # the client's packet, quoted
    assert not list(table.maps.conntrack.keys())


def test_a_packet_that_cannot_be_quoted_is_dropped_instead(hook, table):
    table.set_backends(TCP_SVC, [])
    pkt = eth(IP(src=CLIENT, dst=VIP, options=[IPOption_NOP()] * 4) / TCP(sport=40201, dport=PORT, flags="S"))
    assert hook.run(pkt)[0] == hook.dropped


def test_new_flows_spread_over_all_backends(hook, table):
    counts = {b.addr: 0 for b in BACKENDS}
    for i in range(300):
        counts[Ether(hook.run(syn(sport=20000 + i, client=f"10.0.{i % 7}.{i % 200 + 1}"))[1])[IP].dst] += 1
    assert min(counts.values()) >= 60, counts


def test_per_service_counters(hook, table):
    before = table.counters(table.get(TCP_SVC).svc_id)
    raw = bytes(syn(sport=40300))
    hook.run(raw)
    hook.run(syn(sport=40300, flags="A"))
    after = table.counters(table.get(TCP_SVC).svc_id)
    assert after.new_flows - before.new_flows == 1
    assert after.fwd_packets - before.fwd_packets == 2
    assert after.fwd_bytes - before.fwd_bytes == 2 * len(raw)





def test_backend_swap_never_exposes_a_half_written_service(hook, table):
    """Another process flips the service between 3 and 5 backends as fast as it can
    while 8000 new flows arrive: every packet must find a backend of one set or the other."""
    allowed = {(b.addr, b.port) for b in BACKENDS} | {(f"10.2.0.{i}", 9090) for i in range(1, 6)}
    frames = [bytes(syn(sport=1024 + n % 60000, client=f"10.9.{n // 60000}.1")) for n in range(8000)]
    sets = [[Backend(f"10.2.0.{i}", 9090) for i in range(1, 6)], BACKENDS]
    writer = start_flipper(table.maps.pin_dir, TCP_SVC, sets)
    try:
        for frame in frames:
            verdict, out = hook.run(frame)
            assert verdict == hook.translated
            p = Ether(out)
            assert (p[IP].dst, p[TCP].dport) in allowed
            assert writer.poll() is None, "the flipper ended while the frames were sent"
    finally:
        flips = flips_done(writer)
    assert flips > 50, flips


NODE_IP = "10.250.0.11"


def in_src_port_range(port: int) -> bool:
    return C["SRC_PORT_MIN"] <= port <= C["SRC_PORT_MAX"]


@pytest.fixture
def masquerade(table):
    table.set_config(DatapathConfig(snat_addrs=(NODE_IP,), cluster_cidrs=("10.0.0.0/16",)))
    yield table
    table.set_config(DatapathConfig())


def test_hairpin_flow_is_masqueraded_both_ways(hook, masquerade):
    masquerade.set_backends(TCP_SVC, [Backend(CLIENT, 8080)])  # the client is the backend
    verdict, out = hook.run(syn(sport=40500))
    p = assert_checksums(out)
    assert (p[IP].src, p[IP].dst, p[TCP].dport) == (NODE_IP, CLIENT, 8080)
    assert in_src_port_range(p[TCP].sport)  # never the client's port: the node's sockets could hold it
    reply = eth(IP(src=CLIENT, dst=NODE_IP) / TCP(sport=8080, dport=p[TCP].sport, flags="SA") / b"r")
    p = assert_checksums(hook.run(reply)[1])
    assert (p[IP].src, p[TCP].sport, p[IP].dst, p[TCP].dport) == (VIP, PORT, CLIENT, 40500)


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_a_checksum_complete_skb_keeps_a_true_sum(complete, masquerade, proto):
    """The IPv4 rewrites at tc on a NIC that sums every packet (CHECKSUM_COMPLETE): both
    ways, ICMP errors both ways, and a masqueraded flow leave the sum the stack trusts
    true (the test run checks it)."""
    sport = 40030 if proto is TCP else 6030
    out = Ether(complete.run(eth(IP(src=CLIENT, dst=VIP) / proto(sport=sport, dport=PORT) / b"q"))[1])
    backend = out[IP].dst
    assert backend in BACKEND_ADDRS
    err = eth(IP(src=backend, dst=CLIENT) / ICMP(type=3, code=3) / bytes(out[IP])[:28])
    verdict, got = complete.run(err)
    assert verdict == complete.translated and Ether(got)[IP].src == VIP
    verdict, reply = complete.run(eth(IP(src=backend, dst=CLIENT) / proto(sport=8080, dport=sport) / b"r"))
    assert verdict == complete.translated and (Ether(reply)[IP].src, Ether(reply)[proto].sport) == (VIP, PORT)
    err = eth(IP(src=CLIENT, dst=VIP) / ICMP(type=3, code=3) / bytes(Ether(reply)[IP])[:28])
    verdict, got = complete.run(err)
    assert verdict == complete.translated and Ether(got)[IP].dst == backend
    out = assert_checksums(complete.run(eth(IP(src="192.0.2.9", dst=VIP) / proto(sport=sport, dport=PORT)))[1])
    assert out[IP].src == NODE_IP and in_src_port_range(out[proto].sport)
    verdict, reply = complete.run(eth(IP(src=out[IP].dst, dst=NODE_IP) / proto(sport=8080, dport=out[proto].sport)))
    assert verdict == complete.translated and Ether(reply)[IP].dst == "192.0.2.9"


def test_clients_outside_the_cluster_cidr_are_masqueraded_inside_ones_not(hook, masquerade):
    inside = Ether(hook.run(syn(sport=40600))[1])
    assert inside[IP].src == CLIENT
    outside = assert_checksums(hook.run(syn(sport=40600, client="192.0.2.9"))[1])
    assert outside[IP].src == NODE_IP and in_src_port_range(outside[TCP].sport)
    backend, port = outside[IP].dst, outside[TCP].sport
    reply = eth(IP(src=backend, dst=NODE_IP) / UDP(sport=8080, dport=port) / b"r")
    assert Ether(hook.run(reply)[1])[IP].dst == NODE_IP  # UDP: no such flow, untouched
    p = assert_checksums(hook.run(eth(IP(src=backend, dst=NODE_IP) / TCP(sport=8080, dport=port, flags="SA")))[1])
    assert (p[IP].src, p[IP].dst, p[TCP].dport) == (VIP, "192.0.2.9", 40600)


def test_masquerade_port_collision_picks_another_port(hook, masquerade):
    masquerade.set_backends(TCP_SVC, BACKENDS[:1])
    a = assert_checksums(hook.run(syn(sport=40700, client="192.0.2.1"))[1])
    b = assert_checksums(hook.run(syn(sport=40700, client="192.0.2.2"))[1])
    assert a[TCP].sport != b[TCP].sport and in_src_port_range(a[TCP].sport) and in_src_port_range(b[TCP].sport)
    for p, client in ((a, "192.0.2.1"), (b, "192.0.2.2")):
        back = eth(IP(src=p[IP].dst, dst=NODE_IP) / TCP(sport=8080, dport=p[TCP].sport, flags="SA"))
        r = Ether(hook.run(back)[1])
        assert (r[IP].src, r[IP].dst, r[TCP].dport) == (VIP, client, 40700)


def test_a_run_given_to_another_set_is_never_read_as_this_ones(hook, table):
    """Backend slots are runs of an array (maps.h backend_map): a run freed after a swap is
    given to another set after its quarantine. A packet that still held the old entry then
    finds the other set's tag in the slots, and re-reads the entry instead of sending the
    new flow to the other service's backends."""
    import ctypes

    from kxlb.loader.services import slot_tag

    st = table.get(TCP_SVC)
    other = table.get(UDP_SVC)
    slots = table.maps.backends
    strangers = [Backend(f"10.9.0.{i}", 9090) for i in (1, 2, 3)]

    def write(tag):
        for i, b in enumerate(strangers):
            c = b.to_c()
            c.tag = tag
            slots.put(ctypes.c_uint32(st.runs[0] + i), c)

    write(slot_tag(other.svc_id, other.gen))          # the run is the UDP service's now
    before = table.datapath_counters()["slot_retry"]
    outs = [hook.run(syn(sport=43000 + i)) for i in range(20)]
    assert all(v != hook.translated for v, _ in outs)
    assert table.datapath_counters()["slot_retry"] - before == 20
    write(slot_tag(st.svc_id, st.gen))                 # the same bytes under this set's tag are read
    dsts = {Ether(hook.run(syn(sport=43100 + i))[1])[IP].dst for i in range(30)}
    assert dsts == {b.addr for b in strangers}
