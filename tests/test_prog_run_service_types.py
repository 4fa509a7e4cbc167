"""Service types and policies in the datapath (BPF_PROG_TEST_RUN, tc and XDP): NodePort,
externalIPs, load-balancer IPs, traffic policies, session affinity, source ranges, and
kube-proxy's reject/drop rules; with the service model's round trip through the maps.

Addresses: pods in 10.0.0.0/16 (the cluster CIDR), the node at NODE_IP, an outside
client in 192.0.2.0/24, services in 10.96.0.0/16.
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest

from scapy.layers.inet import fragment

from harness import clean_table, ICMP, IP, TCP, UDP, Ether, assert_checksums, eth
from kxlb.loader.errors import KxlbError
from kxlb.loader.journal import range_key
from kxlb.loader.layout import V4, C, Backend, ServiceKey, ip_to_raw
from kxlb.loader.services import DatapathConfig, ServiceTable
from kxlb.loader.svcspec import Frontend, Kind, LbService

NODE_IP = "10.250.0.11"
POD = "10.0.0.2"                 # a client pod (inside the cluster CIDR)
OUTSIDE = "192.0.2.9"            # a client outside the cluster
CIP, PORT = "10.96.0.20", 80
NODE_PORT = 30080
EXT_IP = "203.0.113.7"
LB_IP = "198.51.100.5"
LOCAL = (Backend("10.0.1.11", 8080),)                            # this node's endpoint
REMOTE = (Backend("10.0.2.11", 8080), Backend("10.0.2.12", 8080))  # other nodes'
KEY = ServiceKey(CIP, PORT, 6)
FRONTENDS = (Frontend(ServiceKey(NODE_IP, NODE_PORT, 6), Kind.NODE_PORT),
             Frontend(ServiceKey(EXT_IP, PORT, 6), Kind.EXTERNAL_IP),
             Frontend(ServiceKey(LB_IP, PORT, 6), Kind.LOAD_BALANCER))
CONFIG = DatapathConfig(snat_addrs=(NODE_IP,), cluster_cidrs=("10.0.0.0/16",), service_cidrs=("10.96.0.0/16",))


@pytest.fixture
def table(dp):
    with clean_table(dp[1]) as t:
        t.set_config(CONFIG)
        yield t


def svc(**kw) -> LbService:
    base = dict(key=KEY, cluster=LOCAL + REMOTE, frontends=FRONTENDS, has_endpoints=True, name="default/web:http")
    base.update(kw)
    return LbService(**base)


_port = iter(range(41000, 60000))


def send(hook, dst, dport, client=POD, proto="tcp"):
    """A new flow's first packet; returns (verdict, parsed output or None)."""
    sport = next(_port)
    l4 = TCP(sport=sport, dport=dport, flags="S") if proto == "tcp" else UDP(sport=sport, dport=dport)
    verdict, out = hook.run(eth(IP(src=client, dst=dst) / l4 / b"x"))
    return verdict, out, sport


def forwarded(hook, dst, dport, client=POD):
    """(source, destination) of the translated packet; fails unless it is forwarded."""
    verdict, out, _ = send(hook, dst, dport, client)
    assert verdict == hook.translated, f"verdict {verdict}"
    p = assert_checksums(out)
    return p[IP].src, p[IP].dst


def assert_rejected(hook, dst, dport, client=POD, proto="tcp"):
    verdict, out, _ = send(hook, dst, dport, client, proto)
    assert verdict == hook.sent_back
    p = Ether(out)
    assert (p[IP].src, p[IP].dst, p[ICMP].type, p[ICMP].code) == (dst, client, 3, 3)


def assert_dropped(hook, dst, dport, client=POD):
    assert send(hook, dst, dport, client)[0] == hook.dropped


def backends_reached(hook, dst, dport, client, n=40):
    return {forwarded(hook, dst, dport, client)[1] for _ in range(n)}


ALL = {b.addr for b in LOCAL + REMOTE}


# --- the service model through the maps --------------------------------------------------

def test_a_service_port_reads_back_as_written(table):
    spec = svc(local=LOCAL, external_local=True, affinity_s=600, source_ranges=("192.0.2.0/24", "10.1.2.3/32"))
    table.put(spec)
    fresh = ServiceTable(table.maps)
    assert fresh.read_all()[KEY].spec == spec.canonical()
    assert fresh.get(KEY).spec.source_ranges == ("10.1.2.3/32", "192.0.2.0/24")


def test_every_frontend_shares_one_svc_id_and_a_marker_guards_the_cluster_ip(table):
    st = table.put(svc())
    for fe in FRONTENDS:
        v = table.maps.services.get(fe.key.to_c())
        assert (v.svc_id, v.kind, v.count) == (st.svc_id, fe.kind, 3)
    marker = table.maps.services.get(ServiceKey(CIP, 0, 0).to_c())
    assert marker is not None and marker.kind == C["KIND_MARKER"]
    table.delete(KEY)
    assert table.maps.services.get(ServiceKey(CIP, 0, 0).to_c()) is None
    assert not list(table.maps.services.keys()) and not list(table.maps.maglev.keys())


def test_a_frontend_owned_by_another_service_is_refused(table):
    table.put(svc())
    other = LbService(key=ServiceKey("10.96.0.21", 80, 6), cluster=REMOTE, has_endpoints=True, name="default/other:80",
                      frontends=(Frontend(ServiceKey(EXT_IP, PORT, 6), Kind.EXTERNAL_IP),))
    with pytest.raises(KxlbError, match=r"default/other:80.*203\.0\.113\.7:80/tcp.*already served by 10\.96\.0\.20"):
        table.put(other)
    assert table.maps.services.get(other.key.to_c()) is None


def test_removing_a_frontend_removes_only_its_entry(table):
    table.put(svc())
    table.put(svc(frontends=FRONTENDS[:1]))
    assert table.maps.services.get(FRONTENDS[1].key.to_c()) is None
    assert table.maps.services.get(FRONTENDS[0].key.to_c()) is not None


# --- NodePort, externalIPs, load balancers ------------------------------------------------

@pytest.mark.parametrize("frontend", FRONTENDS, ids=lambda f: f.kind.label)
@pytest.mark.parametrize("client", [POD, OUTSIDE], ids=["pod", "outside"])
def test_external_frontends_with_policy_cluster_are_masqueraded(hook, table, frontend, client):
    table.put(svc())
    src, dst = forwarded(hook, frontend.key.vip, frontend.key.port, client)
    assert src == NODE_IP and dst in ALL


def test_a_nodeport_reply_is_translated_back_to_the_node_address(hook, table):
    table.put(svc(cluster=REMOTE[:1]))
    verdict, out, sport = send(hook, NODE_IP, NODE_PORT, OUTSIDE)
    p = Ether(out)
    reply = eth(IP(src=p[IP].dst, dst=NODE_IP) / TCP(sport=8080, dport=p[TCP].sport, flags="SA"))
    r = assert_checksums(hook.run(reply)[1])
    assert (r[IP].src, r[TCP].sport, r[IP].dst, r[TCP].dport) == (NODE_IP, NODE_PORT, OUTSIDE, sport)


# This node's own address as an endpoint (a hostNetwork pod): packets to it are delivered
# locally and its replies start in the node's stack, so they meet only tc egress.
HOST = Backend(NODE_IP, 18080)
FROM_EVERYWHERE = [(NODE_IP, NODE_PORT, OUTSIDE), (NODE_IP, NODE_PORT, POD), (EXT_IP, PORT, OUTSIDE),
                   (CIP, PORT, POD)]


def host_reply(client: str, sport: int, proto: str = "tcp", payload: bytes = b"y"):
    """The host-network endpoint's answer, as the node's stack sends it."""
    l4 = TCP(sport=HOST.port, dport=sport, flags="SA") if proto == "tcp" else UDP(sport=HOST.port, dport=sport)
    return eth(IP(src=NODE_IP, dst=client) / l4 / payload)


@pytest.mark.parametrize("front, fport, client", FROM_EVERYWHERE,
                         ids=["nodeport-outside", "nodeport-pod", "external-ip", "cluster-ip"])
def test_this_nodes_host_network_endpoint_is_not_masqueraded_and_answers_through_egress(
        hook, table, egress, front, fport, client):
    """kube-proxy masquerades in POSTROUTING, which a locally delivered packet never
    reaches: the node's own endpoint sees the client. Masqueraded to the node's address,
    its reply would go through lo, past every hook (upstream e2e: "service endpoints
    using hostNetwork")."""
    table.put(svc(cluster=(HOST,)))
    verdict, out, sport = send(hook, front, fport, client)
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert (p[IP].src, p[TCP].sport, p[IP].dst, p[TCP].dport) == (client, sport, NODE_IP, HOST.port)
    verdict, out = egress.run(host_reply(client, sport))
    assert verdict == 0  # TC_ACT_OK: translated
    r = assert_checksums(out)
    assert (r[IP].src, r[TCP].sport, r[IP].dst, r[TCP].dport) == (front, fport, client, sport)


def test_an_endpoint_on_another_local_address_answers_through_egress(hook, table, egress):
    """An endpoint on a local address that is not the node's (an API server's advertise
    address on lo, the `kubernetes` Service's endpoint): a pod's packets to the cluster IP
    are delivered locally, and the replies, sent from that address, are translated at
    egress like the node address's (the backend filter knows the address and port)."""
    api = Backend("10.254.0.1", 6443)
    table.put(svc(cluster=(api,)))
    verdict, out, sport = send(hook, CIP, PORT, POD)
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert (p[IP].dst, p[TCP].dport) == (api.addr, api.port)
    reply = eth(IP(src=api.addr, dst=POD) / TCP(sport=api.port, dport=sport, flags="SA"))
    verdict, out = egress.run(reply)
    assert verdict == 0
    r = assert_checksums(out)
    assert (r[IP].src, r[TCP].sport, r[IP].dst, r[TCP].dport) == (CIP, PORT, POD, sport)
    other = eth(IP(src=api.addr, dst=POD) / TCP(sport=api.port + 1, dport=sport, flags="SA"))
    assert egress.run(other) == (-1, bytes(other))  # not a backend's port: untouched


def test_a_remote_endpoint_through_the_node_port_is_still_masqueraded(hook, table):
    table.put(svc(cluster=REMOTE[:1]))
    assert forwarded(hook, NODE_IP, NODE_PORT, OUTSIDE) == (NODE_IP, REMOTE[0].addr)


def test_a_large_udp_answer_of_the_host_endpoint_is_translated_fragment_by_fragment(hook, table, egress):
    table.put(svc(key=ServiceKey(CIP, PORT, 17), cluster=(HOST,),
                  frontends=(Frontend(ServiceKey(NODE_IP, NODE_PORT, 17), Kind.NODE_PORT),)))
    verdict, _, sport = send(hook, NODE_IP, NODE_PORT, OUTSIDE, proto="udp")
    assert verdict == hook.translated
    datagram = host_reply(OUTSIDE, sport, "udp", b"n" + b"o" * 2499)[IP]
    datagram.id = 777
    outs = []
    for f in fragment(datagram, fragsize=1000):
        verdict, out = egress.run(eth(f))
        assert verdict == 0
        outs.append(Ether(out)[IP])
    assert all((o.src, o.dst) == (NODE_IP, OUTSIDE) for o in outs)
    whole = IP(src=NODE_IP, dst=OUTSIDE) / UDP(b"".join(bytes(o.payload) for o in outs))
    assert (whole[UDP].sport, whole[UDP].dport) == (NODE_PORT, sport)
    check = whole[UDP].chksum
    del whole[UDP].chksum
    assert IP(bytes(whole))[UDP].chksum == check


def test_egress_leaves_the_nodes_other_traffic_alone(hook, table, egress):
    """Only a reply of a tracked flow's local endpoint is translated: the node's other
    sockets (another port, another peer, a later fragment of its own) are not."""
    table.put(svc(cluster=(HOST,)))
    sport = send(hook, NODE_IP, NODE_PORT, OUTSIDE)[2]
    for frame in (eth(IP(src=NODE_IP, dst=OUTSIDE) / TCP(sport=22, dport=sport, flags="A")),
                  eth(IP(src=NODE_IP, dst="192.0.2.10") / TCP(sport=HOST.port, dport=sport, flags="A")),
                  eth(IP(src=NODE_IP, dst=OUTSIDE) / TCP(sport=sport, dport=HOST.port, flags="A")),
                  eth(IP(src=NODE_IP, dst=OUTSIDE, id=5, frag=125, proto=17) / (b"z" * 64))):
        verdict, out = egress.run(frame)
        assert verdict == -1 and out == bytes(frame)  # TC_ACT_UNSPEC, untouched


def test_cluster_ip_masquerades_only_clients_outside_the_cluster(hook, table):
    table.put(svc())
    assert forwarded(hook, CIP, PORT, POD)[0] == POD
    assert forwarded(hook, CIP, PORT, OUTSIDE)[0] == NODE_IP
    table.set_config(DatapathConfig(snat_addrs=(NODE_IP,), cluster_cidrs=("10.0.0.0/16",), masquerade_all=True))
    assert forwarded(hook, CIP, PORT, POD)[0] == NODE_IP


# --- externalTrafficPolicy: Local ---------------------------------------------------------

@pytest.mark.parametrize("frontend", FRONTENDS, ids=lambda f: f.kind.label)
def test_etp_local_keeps_outside_clients_on_local_endpoints_with_their_source(hook, table, frontend):
    table.put(svc(local=LOCAL, external_local=True))
    for _ in range(10):
        assert forwarded(hook, frontend.key.vip, frontend.key.port, OUTSIDE) == (OUTSIDE, LOCAL[0].addr)


def test_etp_local_short_circuits_pods_to_every_endpoint_unmasqueraded(hook, table):
    table.put(svc(local=LOCAL, external_local=True))
    reached = set()
    for _ in range(40):
        src, dst = forwarded(hook, LB_IP, PORT, POD)
        assert src == POD
        reached.add(dst)
    assert reached == ALL


def test_etp_local_without_a_local_endpoint_drops_outside_clients_only(hook, table):
    table.put(svc(cluster=REMOTE, local=(), external_local=True))
    assert_dropped(hook, NODE_IP, NODE_PORT, OUTSIDE)
    assert_dropped(hook, LB_IP, PORT, OUTSIDE)
    assert forwarded(hook, LB_IP, PORT, POD)[1] in {b.addr for b in REMOTE}
    assert forwarded(hook, CIP, PORT, OUTSIDE)[1] in {b.addr for b in REMOTE}  # the cluster IP: eTP n/a


# --- internalTrafficPolicy: Local ------------------------------------------------------------

def test_itp_local_uses_only_local_endpoints_for_the_cluster_ip(hook, table):
    table.put(svc(cluster=LOCAL + REMOTE, local=LOCAL, internal_local=True))
    assert backends_reached(hook, CIP, PORT, POD, 10) == {LOCAL[0].addr}
    assert len(backends_reached(hook, LB_IP, PORT, OUTSIDE)) == 3  # external: eTP Cluster


def test_itp_local_without_a_local_endpoint_drops(hook, table):
    table.put(svc(cluster=(), local=(), internal_local=True, frontends=()))
    assert_dropped(hook, CIP, PORT, POD)


# --- reject and drop -------------------------------------------------------------------------

@pytest.mark.parametrize("target", [(CIP, PORT), (NODE_IP, NODE_PORT), (EXT_IP, PORT), (LB_IP, PORT)],
                         ids=["clusterIP", "nodePort", "externalIP", "loadBalancer"])
@pytest.mark.parametrize("client", [POD, OUTSIDE], ids=["pod", "outside"])
def test_no_endpoints_anywhere_rejects_from_every_frontend(hook, table, target, client):
    table.put(svc(cluster=(), local=(), has_endpoints=False, external_local=True))
    assert_rejected(hook, *target, client)


def test_a_cluster_ip_port_that_no_service_defines_is_rejected(hook, table):
    table.put(svc())
    assert_rejected(hook, CIP, 81)
    assert_rejected(hook, CIP, PORT, proto="udp")  # only TCP is defined
    verdict, out = hook.run(eth(IP(src=POD, dst=CIP) / ICMP(type=8) / b"ping"))
    assert verdict == hook.sent_back and Ether(out)[ICMP].type == 3


def test_an_unallocated_service_address_is_dropped_and_others_pass(hook, table):
    table.put(svc())
    assert_dropped(hook, "10.96.0.99", PORT)
    verdict, out, _ = send(hook, "10.97.0.99", PORT)   # outside the service CIDR: not ours
    assert verdict == hook.passed and Ether(out)[IP].dst == "10.97.0.99"


def test_more_service_cidrs_than_the_config_holds_are_each_dropped_or_rejected(hook, table):
    """kube-proxy takes any number of ServiceCIDR objects. The config entry holds the
    first four of a family; the rest go into the source range map under service id 0,
    flagged in the config, and their addresses are treated as the first four's."""
    extra = tuple(f"10.{200 + i}.0.0/16" for i in range(5))      # 6 CIDRs: 10.204/16 past the config's 4
    table.set_config(replace(CONFIG, service_cidrs=CONFIG.service_cidrs + extra))
    cfg = table.maps.config.get(ctypes.c_uint32(0))
    assert cfg.flags & C["CFG_F_SVC_CIDR_MAP"]
    assert sorted((k.svc_id, k.prefixlen) for k in table.maps.src_ranges.keys()) == [(0, 32 + 16)] * 6
    assert set(table.read_config().service_cidrs) == set(CONFIG.service_cidrs + extra)
    table.put(svc(key=ServiceKey("10.204.0.20", PORT, 6), frontends=()))
    assert_dropped(hook, "10.204.0.99", PORT)          # unallocated, in the sixth CIDR
    assert_rejected(hook, "10.204.0.20", 81)           # its cluster IP, on a port no Service has
    assert forwarded(hook, "10.204.0.20", PORT)[1] in ALL
    verdict, out, _ = send(hook, "10.210.0.99", PORT)  # in none: not ours
    assert verdict == hook.passed and Ether(out)[IP].dst == "10.210.0.99"

    table.set_config(CONFIG)   # back to one: the entries go, after the flag
    assert not table.maps.config.get(ctypes.c_uint32(0)).flags & C["CFG_F_SVC_CIDR_MAP"]
    assert not list(table.maps.src_ranges.keys()) and table.read_config().service_cidrs == CONFIG.service_cidrs
    verdict, _, _ = send(hook, "10.204.0.99", PORT)
    assert verdict == hook.passed


def test_service_cidrs_without_room_in_the_range_map_keep_the_first_four_and_name_the_rest(hook, table):
    """The source range map full (another writer's ranges): the config keeps its own four
    CIDRs without the flag, the error names the ones left out, and nothing else changes."""
    ranges = table.maps.src_ranges
    filler = [range_key(V4, 999, f"10.{150 + i // 256}.{i % 256}.0/24") for i in range(ranges.max_entries)]
    try:
        for k in filler:
            ranges.put(k, ctypes.c_uint8(1))
        extra = tuple(f"10.{200 + i}.0.0/16" for i in range(5))
        with pytest.raises(KxlbError, match=r"10\.204\.0\.0/16"):
            table.set_config(replace(CONFIG, service_cidrs=CONFIG.service_cidrs + extra))
        cfg = table.maps.config.get(ctypes.c_uint32(0))
        assert not cfg.flags & C["CFG_F_SVC_CIDR_MAP"]
        assert table.read_config().service_cidrs == CONFIG.service_cidrs + extra[:3]
        assert not any(k.svc_id == 0 for k in ranges.keys())
        assert_dropped(hook, "10.202.0.99", PORT)                 # the fourth: in the config itself
        verdict, _, _ = send(hook, "10.204.0.99", PORT)         # the sixth: not known, so not ours
        assert verdict == hook.passed
    finally:
        for k in filler:
            ranges.delete(k)
        table.set_config(CONFIG)


# --- loadBalancerSourceRanges ------------------------------------------------------------------

def test_source_ranges_filter_the_load_balancer_ip_but_not_the_nodeport(hook, table):
    table.put(svc(source_ranges=("192.0.2.0/28",)))
    assert forwarded(hook, LB_IP, PORT, "192.0.2.9")[1] in ALL
    assert_dropped(hook, LB_IP, PORT, "192.0.2.77")
    assert forwarded(hook, NODE_IP, NODE_PORT, "192.0.2.77")[1] in ALL
    assert forwarded(hook, EXT_IP, PORT, "192.0.2.77")[1] in ALL
    table.put(svc())  # ranges removed: everyone again
    assert forwarded(hook, LB_IP, PORT, "192.0.2.77")[1] in ALL
    assert not list(table.maps.src_ranges.keys())


# --- sessionAffinity: ClientIP -----------------------------------------------------------------

def test_affinity_keeps_a_client_on_one_backend_across_frontends(hook, table):
    table.put(svc(affinity_s=10800))
    first = forwarded(hook, CIP, PORT, POD)[1]
    for dst, dport in [(CIP, PORT)] * 10 + [(LB_IP, PORT), (NODE_IP, NODE_PORT)]:
        assert forwarded(hook, dst, dport, POD)[1] == first
    others = {forwarded(hook, CIP, PORT, f"10.0.3.{i}")[1] for i in range(1, 40)}
    assert len(others) == 3  # other clients still spread


def _age_affinity(table, client, seconds):
    for k, v in table.maps.affinity.items():
        if k.client == ip_to_raw(client):
            v.last_ns -= int(seconds * 1e9)
            table.maps.affinity.put(k, v)


def test_affinity_expires_after_its_timeout_without_new_connections(hook, table):
    table.put(svc(affinity_s=60))
    picks = set()
    for _ in range(30):
        picks.add(forwarded(hook, CIP, PORT, POD)[1])
        _age_affinity(table, POD, 61)
    assert len(picks) > 1
    first = forwarded(hook, CIP, PORT, POD)[1]
    _age_affinity(table, POD, 59)  # within the timeout: kept
    assert forwarded(hook, CIP, PORT, POD)[1] == first


def test_affinity_to_a_removed_backend_is_forgotten(hook, table):
    table.put(svc(affinity_s=10800))
    first = forwarded(hook, CIP, PORT, POD)[1]
    rest = tuple(b for b in LOCAL + REMOTE if b.addr != first)
    table.put(svc(cluster=rest, affinity_s=10800))
    assert forwarded(hook, CIP, PORT, POD)[1] in {b.addr for b in rest}


def test_switching_affinity_off_forgets_every_client(hook, table):
    table.put(svc(affinity_s=10800))
    forwarded(hook, CIP, PORT, POD)
    assert list(table.maps.affinity.keys())
    table.put(svc())
    assert not list(table.maps.affinity.keys())
    assert len(backends_reached(hook, CIP, PORT, POD)) == 3


def test_the_datapath_counts_policy_decisions(hook, table):
    before = table.datapath_counters()
    table.put(svc(cluster=REMOTE, local=(), external_local=True, affinity_s=60, source_ranges=("192.0.2.0/28",)))
    assert_dropped(hook, NODE_IP, NODE_PORT, OUTSIDE)       # no local endpoint
    assert_dropped(hook, LB_IP, PORT, "192.0.2.77")          # source range
    assert_rejected(hook, CIP, 81)                           # bad port
    assert_dropped(hook, "10.96.0.99", PORT)                 # unallocated
    forwarded(hook, CIP, PORT)
    forwarded(hook, CIP, PORT)                               # affinity hit
    after = table.datapath_counters()
    for name in ("no_local", "src_range", "bad_port", "unallocated", "affinity"):
        assert after[name] - before[name] == 1, name


def test_two_services_claiming_one_external_ip_both_serve_and_the_frontend_moves_when_freed(table):
    """kube-proxy serves such a clash (one wins), never neither: the second service port is
    programmed without the contested frontend, and gets it once the first lets go."""
    from kxlb.controller.programmer import Programmer

    prog = Programmer(table.maps)
    ext = Frontend(ServiceKey(EXT_IP, PORT, 6), Kind.EXTERNAL_IP)
    a = svc(frontends=(ext,))
    b = LbService(key=ServiceKey("10.96.0.21", PORT, 6), cluster=REMOTE, has_endpoints=True, frontends=(ext,),
                  name="default/b:80")
    res = prog.apply({a.key: a, b.key: b})
    assert set(prog.current) == {a.key, b.key}
    owner = table.maps.services.get(ext.key.to_c()).svc_id
    winner, loser = (a, b) if owner == prog.current[a.key].svc_id else (b, a)
    assert prog.current[loser.key].spec.frontends == () and any("left out" in f for f in res.failed)
    prog.apply({loser.key: loser, winner.key: replace(winner, frontends=())})
    assert table.maps.services.get(ext.key.to_c()).svc_id == prog.current[loser.key].svc_id
    assert prog.current[loser.key].spec.frontends == (ext,)


def test_an_icmp_error_to_a_live_cluster_ip_is_dropped_not_answered(hook, table):
    """RFC 1122 3.2.2: no ICMP error about an ICMP error (an echo still gets one)."""
    table.put(svc())
    quoted = IP(src=CIP, dst=POD) / UDP(sport=PORT, dport=40999)
    err = eth(IP(src=POD, dst=CIP) / ICMP(type=3, code=3) / bytes(quoted)[:28])
    assert hook.run(err)[0] == hook.dropped
    verdict, out = hook.run(eth(IP(src=POD, dst=CIP) / ICMP(type=8) / b"ping"))
    assert verdict == hook.sent_back


def test_a_reused_service_id_starts_with_zero_counters(hook, table):
    first = table.add_many([svc(frontends=())])[0]
    forwarded(hook, CIP, PORT)
    assert table.counters(first.svc_id).new_flows == 1
    table.delete(KEY)
    second = table.add_many([svc(key=ServiceKey("10.96.0.30", PORT, 6), frontends=())])[0]
    assert second.svc_id == first.svc_id and table.counters(second.svc_id).new_flows == 0
