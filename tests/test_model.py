"""Desired state from Services and EndpointSlices: kube-proxy's rules, without a kernel."""
from __future__ import annotations

from kxlb.controller.decode import decode_service, decode_slice
from kxlb.controller.model import NodeContext, desired_state
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.svcspec import Frontend, Kind

NODE = NodeContext(name="node-a", zone="zone-a", nodeport_addresses=("192.168.0.10", "10.1.0.10"),
                   ip="192.168.0.10")


def svc(name="web", ips=("10.96.0.10",), ports=(("http", 80, "TCP"),), type_="ClusterIP", ns="default",
        node_ports=(), status=None, **spec):
    """A Service as the API serves it; ``spec`` adds fields (camelCase); node_ports
    gives ports[i].nodePort in order."""
    pl = [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports]
    for p, np in zip(pl, node_ports):
        p["nodePort"] = np
    obj = {"metadata": {"namespace": ns, "name": name},
           "spec": {"type": type_, "clusterIPs": list(ips), "ports": pl, **spec}}
    if status:
        obj["status"] = status
    return decode_service(obj)


def ep(ip, cond=None, node=None, zones=(), nodes=()):
    e = {"addresses": [ip], "conditions": cond or {}}
    if node:
        e["nodeName"] = node
    if zones or nodes:
        e["hints"] = {"forZones": [{"name": z} for z in zones], "forNodes": [{"name": n} for n in nodes]}
    return e


def eps(name, service="web", endpoints=(), ports=(("http", 8080, "TCP"),), atype="IPv4", ns="default"):
    """endpoints: (ip, conditions) pairs or dicts made by ep()."""
    return decode_slice({"metadata": {"namespace": ns, "name": name, "labels": {"kubernetes.io/service-name": service}},
                         "addressType": atype,
                         "endpoints": [e if isinstance(e, dict) else ep(*e) for e in endpoints],
                         "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports]})


def desired(services, slices, node=NODE):
    return desired_state({s.id: s for s in services}, {f"{s.namespace}/{s.name}": s for s in slices}, node)


def state(services, slices):
    """key -> cluster backend set."""
    return {k: lb.cluster for k, lb in desired(services, slices).services.items()}


def one(services, slices, node=NODE):
    """The single service port's LbService."""
    d = desired(services, slices, node)
    (lb,) = d.services.values()
    return lb


READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}
NOT_READY = {"ready": False, "serving": False, "terminating": False}
KEY = ServiceKey("10.96.0.10", 80, 6)


def B(ip, port=8080):
    return Backend(ip, port)


# --- endpoints ------------------------------------------------------------------------

def test_ready_endpoints_of_all_slices_are_merged_in_a_stable_order():
    got = state([svc()], [eps("a", endpoints=[("10.0.0.12", READY), ("10.0.0.3", NOT_READY)]),
                          eps("b", endpoints=[("10.0.0.2", READY)])])
    assert got == {KEY: (B("10.0.0.2"), B("10.0.0.12"))}


def test_terminating_endpoints_only_when_none_is_ready():
    only_terminating = state([svc()], [eps("a", endpoints=[("10.0.0.5", TERMINATING), ("10.0.0.6", NOT_READY)])])
    assert only_terminating == {KEY: (B("10.0.0.5"),)}
    mixed = state([svc()], [eps("a", endpoints=[("10.0.0.5", TERMINATING), ("10.0.0.7", READY)])])
    assert mixed == {KEY: (B("10.0.0.7"),)}


def test_absent_conditions_mean_ready():
    assert state([svc()], [eps("a", endpoints=[("10.0.0.8", {})])]) == {KEY: (B("10.0.0.8"),)}


def test_same_address_in_two_slices_non_terminating_wins():
    # (a pod IP reused before the terminating pod is gone; or a pod moving between slices)
    slices = [eps("a", endpoints=[("10.0.0.9", TERMINATING)]),
              eps("b", endpoints=[("10.0.0.9", READY), ("10.0.0.1", READY)])]
    for order in ((0, 1), (1, 0)):
        assert state([svc()], [slices[i] for i in order]) == {KEY: (B("10.0.0.1"), B("10.0.0.9"))}


def test_named_target_port_resolves_per_slice_and_multi_port():
    s = svc(ports=(("http", 80, "TCP"), ("dns", 53, "UDP")))
    got = state([s], [eps("a", endpoints=[("10.0.0.2", READY)], ports=(("http", 8080, "TCP"), ("dns", 5353, "UDP"))),
                      eps("b", endpoints=[("10.0.0.3", READY)], ports=(("http", 9090, "TCP"),))])
    assert got == {KEY: (B("10.0.0.2", 8080), B("10.0.0.3", 9090)),
                   ServiceKey("10.96.0.10", 53, 17): (B("10.0.0.2", 5353),)}


def test_slice_port_without_a_name_is_ignored_and_sloppy_addresses_are_normalised():
    unnamed = decode_slice({"metadata": {"namespace": "default", "name": "u",
                                         "labels": {"kubernetes.io/service-name": "web"}},
                            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.4"]}],
                            "ports": [{"port": 8080, "protocol": "TCP"}]})
    s = svc(ports=(("", 80, "TCP"),))
    assert state([s], [unnamed]) == {KEY: ()}
    assert state([s], [eps("a", endpoints=[("010.000.000.004", READY)], ports=(("", 8080, "TCP"),))]) == \
        {KEY: (B("10.0.0.4"),)}


def test_no_endpoints_is_a_service_with_no_backend():
    lb = one([svc()], [])
    assert (lb.key, lb.cluster, lb.local, lb.has_endpoints, lb.name) == (KEY, (), (), False, "default/web:http")


def test_headless_external_name_and_other_services_slices_are_ignored():
    services = [svc("headless", ips=("None",)), svc("ext", ips=(), type_="ExternalName")]
    assert state(services, [eps("x", service="headless", endpoints=[("10.0.0.2", READY)])]) == {}
    got = state([svc()], [eps("a", endpoints=[("10.0.0.2", READY)]),
                          eps("c", service="other", endpoints=[("10.0.0.99", READY)])])
    assert got == {KEY: (B("10.0.0.2"),)}


KEY6 = ServiceKey("fd00:96::10", 80, 6)
NODE_DUAL = NodeContext(name="node-a", nodeport_addresses=("192.168.0.10", "fd00:192::10"), ip="192.168.0.10",
                        ip6="fd00:192::10")


def test_a_dual_stack_service_is_one_service_port_per_family_with_that_familys_endpoints():
    """clusterIPs [v6, v4] (PreferDualStack with IPv6 primary): both families served,
    each from the EndpointSlices of its addressType only."""
    dual = svc(ips=("fd00:96::10", "10.96.0.10"), ipFamilyPolicy="PreferDualStack")
    got = state([dual], [eps("a", endpoints=[("10.0.0.2", READY)]),
                         eps("b", endpoints=[("fd00:244::2", READY), ("FD00:244:0::1", READY)], atype="IPv6")])
    # the IPv6 address comes out in the one canonical form the maps give back
    assert got == {KEY: (B("10.0.0.2"),), KEY6: (B("fd00:244::1"), B("fd00:244::2"))}
    d = desired([dual], [], NODE_DUAL)
    assert d.owners == {KEY: "default/web:http", KEY6: "default/web:http/IPv6"}


def test_an_ipv6_only_service_gets_ipv6_frontends_ranges_and_node_ports_only():
    s = svc(ips=("fd00:96::10",), type_="LoadBalancer", node_ports=(30080,),
            externalIPs=["203.0.113.7", "2001:db8::7"], loadBalancerSourceRanges=["192.168.0.0/24", "fd00:192::/64"],
            status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"ip": "2001:db8:1::1"}]}})
    lb = one([s], [eps("b", endpoints=[("fd00:244::2", READY)], atype="IPv6")], NODE_DUAL)
    assert lb.key == KEY6 and lb.cluster == (B("fd00:244::2"),)
    assert set(lb.frontends) == {Frontend(ServiceKey("2001:db8:1::1", 80, 6), Kind.LOAD_BALANCER),
                                 Frontend(ServiceKey("2001:db8::7", 80, 6), Kind.EXTERNAL_IP),
                                 Frontend(ServiceKey("fd00:192::10", 30080, 6), Kind.NODE_PORT)}
    # the node (fd00:192::10) is inside the IPv6 range: its load-balancer IPs pass too (allowFromNode)
    assert lb.source_ranges == ("fd00:192::/64", "2001:db8:1::1/128")


def test_a_dual_stack_services_garbage_entries_are_reported_once():
    s = svc(ips=("10.96.0.10", "fd00:96::10"), type_="LoadBalancer", loadBalancerSourceRanges=["nonsense"],
            ports=(("s", 99, "DCCP"),), status={"loadBalancer": {"ingress": [{"ip": "2001:db8:1::1"}]}})
    d = desired([s], [], NODE_DUAL)
    assert len(d.skipped) == 2 and d.services == {}


def test_sctp_ports_are_served_with_their_own_endpoints():
    """kube-proxy serves SCTP (kxlb 0.2 skipped it, and an SCTP-only cluster IP dropped
    everything); a slice's SCTP port is matched by name and protocol, as the TCP one."""
    slices = [eps("b", endpoints=[("10.1.0.5", READY)], ports=(("s", 3868, "SCTP"), ("http", 8080, "TCP")))]
    d = desired([svc(ports=(("s", 99, "SCTP"), ("http", 80, "TCP")))], slices)
    sctp = ServiceKey("10.96.0.10", 99, 132)
    assert set(d.services) == {KEY, sctp} and not d.skipped
    assert d.services[sctp].cluster == (B("10.1.0.5", 3868),) and d.services[KEY].cluster == (B("10.1.0.5"),)
    assert d.owners[sctp] == "default/web:s"


def test_a_protocol_kube_proxy_does_not_serve_is_skipped_with_a_reason():
    d = desired([svc(ports=(("d", 99, "DCCP"), ("http", 80, "TCP")))], [])
    assert set(d.services) == {KEY} and "DCCP" in d.skipped[0] and "default/web" in d.skipped[0]
    assert d.owners == {KEY: "default/web:http"}


# --- frontends ------------------------------------------------------------------------

def test_node_port_listens_on_every_node_address_with_the_node_port():
    lb = one([svc(type_="NodePort", node_ports=(30080,))], [])
    assert lb.frontends == (Frontend(ServiceKey("192.168.0.10", 30080, 6), Kind.NODE_PORT),
                            Frontend(ServiceKey("10.1.0.10", 30080, 6), Kind.NODE_PORT))
    # a LoadBalancer without node ports (allocateLoadBalancerNodePorts: false): none
    assert one([svc(type_="LoadBalancer")], []).frontends == ()
    assert one([svc()], []).frontends == ()


def test_external_ips_ipv4_only_on_the_service_port():
    lb = one([svc(externalIPs=["203.0.113.5", "2001:db8::5", "not-an-ip"])], [])
    assert lb.frontends == (Frontend(ServiceKey("203.0.113.5", 80, 6), Kind.EXTERNAL_IP),)


def test_load_balancer_ingress_skips_proxy_mode_hostnames_and_ipv6():
    status = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "VIP"}, {"ip": "198.51.100.2"},
                                           {"ip": "198.51.100.3", "ipMode": "Proxy"}, {"hostname": "lb.example"},
                                           {"ip": "2001:db8::1", "ipMode": "VIP"}]}}
    lb = one([svc(type_="LoadBalancer", status=status)], [])
    assert lb.frontends == (Frontend(ServiceKey("198.51.100.1", 80, 6), Kind.LOAD_BALANCER),
                            Frontend(ServiceKey("198.51.100.2", 80, 6), Kind.LOAD_BALANCER))


def test_a_frontend_equal_to_another_is_listed_once_load_balancer_first():
    status = {"loadBalancer": {"ingress": [{"ip": "203.0.113.5", "ipMode": "VIP"}]}}
    # externalIP = LB IP: the LB frontend (source ranges apply); NodePort on a node address
    # = an externalIP: listed once; externalIP = the cluster IP: the cluster IP
    s = svc(type_="LoadBalancer", node_ports=(80,), externalIPs=["203.0.113.5", "192.168.0.10", "10.96.0.10"],
            status=status)
    lb = one([s], [], NodeContext("node-a", nodeport_addresses=("192.168.0.10",)))
    assert lb.frontends == (Frontend(ServiceKey("203.0.113.5", 80, 6), Kind.LOAD_BALANCER),
                            Frontend(ServiceKey("192.168.0.10", 80, 6), Kind.EXTERNAL_IP))
    lb.validate(64)   # what the maps accept: no key twice


# --- traffic policies -----------------------------------------------------------------

LOCAL_AND_REMOTE = [ep("10.0.0.1", READY, node="node-a"), ep("10.0.0.2", READY, node="node-b"),
                    ep("10.0.0.3", NOT_READY, node="node-a")]


def test_external_traffic_policy_local_keeps_both_sets():
    lb = one([svc(type_="NodePort", node_ports=(30080,), externalTrafficPolicy="Local")],
             [eps("a", endpoints=LOCAL_AND_REMOTE)])
    # the cluster set stays: pods and the node itself short-circuit to it
    assert lb.cluster == (B("10.0.0.1"), B("10.0.0.2")) and lb.local == (B("10.0.0.1"),)
    assert lb.external_local and not lb.internal_local and lb.has_endpoints


def test_external_traffic_policy_local_without_an_external_way_in_is_ignored():
    lb = one([svc(externalTrafficPolicy="Local")], [eps("a", endpoints=LOCAL_AND_REMOTE)])
    assert (lb.local, lb.external_local) == ((), False)
    # a LoadBalancer with neither node ports nor an ingress IP yet: not reachable from outside
    lb = one([svc(type_="LoadBalancer", externalTrafficPolicy="Local")], [eps("a", endpoints=LOCAL_AND_REMOTE)])
    assert (lb.cluster, lb.local, lb.external_local) == ((B("10.0.0.1"), B("10.0.0.2")), (), False)


def test_internal_traffic_policy_local_uses_only_the_local_set():
    lb = one([svc(internalTrafficPolicy="Local")], [eps("a", endpoints=LOCAL_AND_REMOTE)])
    assert (lb.cluster, lb.local, lb.internal_local, lb.external_local) == ((), (B("10.0.0.1"),), True, False)
    # reachable from outside too: the cluster set is needed again (for external traffic)
    lb = one([svc(type_="NodePort", node_ports=(30080,), internalTrafficPolicy="Local")],
             [eps("a", endpoints=LOCAL_AND_REMOTE)])
    assert (lb.cluster, lb.local) == ((B("10.0.0.1"), B("10.0.0.2")), (B("10.0.0.1"),))


def test_serving_terminating_fallback_is_decided_separately_for_cluster_and_local():
    s = svc(type_="NodePort", node_ports=(30080,), externalTrafficPolicy="Local")
    lb = one([s], [eps("a", endpoints=[ep("10.0.0.1", TERMINATING, node="node-a"), ep("10.0.0.2", READY, node="node-b"),
                                       ep("10.0.0.4", NOT_READY, node="node-a")])])
    assert (lb.cluster, lb.local) == ((B("10.0.0.2"),), (B("10.0.0.1"),))
    lb = one([s], [eps("a", endpoints=[ep("10.0.0.1", TERMINATING, node="node-a"), ep("10.0.0.2", READY, node="node-a"),
                                       ep("10.0.0.3", TERMINATING, node="node-b")])])
    assert (lb.cluster, lb.local) == ((B("10.0.0.2"),), (B("10.0.0.2"),))
    lb = one([s], [eps("a", endpoints=[ep("10.0.0.1", TERMINATING, node="node-b"), ep("10.0.0.3", TERMINATING,
                                                                                      node="node-c")])])
    assert (lb.cluster, lb.local, lb.has_endpoints) == ((B("10.0.0.1"), B("10.0.0.3")), (), True)


def test_internal_local_with_only_remote_endpoints_still_has_endpoints():
    d = desired([svc(internalTrafficPolicy="Local")], [eps("a", endpoints=[ep("10.0.0.2", READY, node="node-b")])])
    lb = d.services[KEY]
    # has_endpoints: drop (no local endpoint), not reject (the service has endpoints)
    assert (lb.cluster, lb.local, lb.has_endpoints) == ((), (), True)
    assert d.no_local == {"internal": 1, "external": 0}
    d = desired([svc(internalTrafficPolicy="Local")], [eps("a", endpoints=[ep("10.0.0.2", NOT_READY, node="node-b")])])
    assert (d.services[KEY].has_endpoints, d.no_local) == (False, {"internal": 0, "external": 0})


def test_no_local_counts_service_ports_per_policy():
    s = svc(type_="LoadBalancer", ports=(("http", 80, "TCP"), ("dns", 53, "UDP")), node_ports=(30080, 30053),
            externalTrafficPolicy="Local", internalTrafficPolicy="Local")
    remote = [eps("a", endpoints=[ep("10.0.0.2", READY, node="node-b")],
                  ports=(("http", 8080, "TCP"), ("dns", 5353, "UDP")))]
    assert desired([s], remote).no_local == {"internal": 2, "external": 2}
    local = [eps("a", endpoints=[ep("10.0.0.2", READY, node="node-a")], ports=(("http", 8080, "TCP"),))]
    assert desired([s], local).no_local == {"internal": 0, "external": 0}   # dns has no endpoints at all
    assert desired([svc(type_="LoadBalancer", node_ports=(30080,))], remote).no_local == {"internal": 0,
                                                                                         "external": 0}
    # eTP Local counts by type (apiservice.ExternalPolicyLocal): a ClusterIP without
    # externalIPs never, a LoadBalancer without node ports or ingress IPs yet does
    assert desired([svc(externalTrafficPolicy="Local")], remote).no_local == {"internal": 0, "external": 0}
    assert desired([svc(type_="LoadBalancer", externalTrafficPolicy="Local")], remote).no_local == \
        {"internal": 0, "external": 1}


def test_an_endpoint_without_node_name_or_a_node_without_name_is_not_local():
    s = svc(internalTrafficPolicy="Local")
    assert one([s], [eps("a", endpoints=[ep("10.0.0.1", READY)])], NodeContext("")).local == ()
    assert one([s], [eps("a", endpoints=[ep("10.0.0.1", READY, node="node-a")])], NodeContext("")).local == ()
    empty_node_name = {"addresses": ["10.0.0.1"], "nodeName": ""}
    assert one([s], [eps("a", endpoints=[empty_node_name])], NodeContext("")).local == ()


# --- topology -------------------------------------------------------------------------

def test_zone_hints_filter_the_cluster_set_when_every_ready_endpoint_has_one():
    hinted = [ep("10.0.0.1", READY, zones=("zone-a",)), ep("10.0.0.2", READY, zones=("zone-b",)),
              ep("10.0.0.3", NOT_READY)]   # not ready: need not be hinted
    assert one([svc()], [eps("a", endpoints=hinted)]).cluster == (B("10.0.0.1"),)
    # not for this zone's node: no filtering
    other_zone = NodeContext("node-c", zone="zone-c")
    assert one([svc()], [eps("a", endpoints=hinted)], other_zone).cluster == (B("10.0.0.1"), B("10.0.0.2"))
    # node without the zone label: no filtering
    assert one([svc()], [eps("a", endpoints=hinted)], NodeContext("node-a")).cluster == (B("10.0.0.1"), B("10.0.0.2"))


def test_zone_hints_ignored_when_a_ready_endpoint_has_none():
    partly = [ep("10.0.0.1", READY, zones=("zone-a",)), ep("10.0.0.2", READY)]
    assert one([svc()], [eps("a", endpoints=partly)]).cluster == (B("10.0.0.1"), B("10.0.0.2"))


def test_node_hints_win_over_zone_hints_and_traffic_distribution_alone_does_nothing():
    hinted = [ep("10.0.0.1", READY, zones=("zone-a",), nodes=("node-x",)),
              ep("10.0.0.2", READY, zones=("zone-a",), nodes=("node-a",)),
              ep("10.0.0.3", READY, zones=("zone-b",), nodes=("node-b",))]
    assert one([svc()], [eps("a", endpoints=hinted)]).cluster == (B("10.0.0.2"),)
    # node hints for other nodes only: fall back to the zone
    assert one([svc()], [eps("a", endpoints=hinted)], NodeContext("node-q", zone="zone-a")).cluster == \
        (B("10.0.0.1"), B("10.0.0.2"))
    # the proxy reads only hints (the EndpointSlice controller writes them from the field)
    plain = [ep("10.0.0.1", READY, node="node-b"), ep("10.0.0.2", READY, node="node-a")]
    assert one([svc(trafficDistribution="PreferSameNode")], [eps("a", endpoints=plain)]).cluster == \
        (B("10.0.0.1"), B("10.0.0.2"))


def test_topology_never_filters_the_local_set_or_the_terminating_fallback():
    s = svc(type_="NodePort", node_ports=(30080,), externalTrafficPolicy="Local")
    hinted = [ep("10.0.0.1", READY, node="node-a", zones=("zone-b",)), ep("10.0.0.2", READY, node="node-b",
                                                                            zones=("zone-a",))]
    lb = one([s], [eps("a", endpoints=hinted)])
    assert (lb.cluster, lb.local) == ((B("10.0.0.2"),), (B("10.0.0.1"),))
    terminating = [ep("10.0.0.1", TERMINATING, zones=("zone-b",)), ep("10.0.0.2", TERMINATING, zones=("zone-b",))]
    assert one([svc()], [eps("a", endpoints=terminating)]).cluster == (B("10.0.0.1"), B("10.0.0.2"))


# --- options --------------------------------------------------------------------------

def test_session_affinity_timeout():
    assert one([svc(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})],
               []).affinity_s == 60
    assert one([svc(sessionAffinity="ClientIP")], []).affinity_s == 10800
    assert one([svc(sessionAffinity="None", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})],
               []).affinity_s == 0


LB_STATUS = {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "VIP"},
                                          {"ip": "198.51.100.2", "ipMode": "VIP"}]}}


def test_source_ranges_trimmed_masked_sloppy_and_invalid_ones_reported():
    d = desired([svc(type_="LoadBalancer", status=LB_STATUS,
                     loadBalancerSourceRanges=[" 10.1.2.3/8 ", "010.020.0.0/16", "2001:db8::/32", "bogus", "",
                                               "10.0.0.0/33"])], [])
    assert d.services[KEY].source_ranges == ("10.0.0.0/8", "10.20.0.0/16")
    assert len(d.skipped) == 2 and all("loadBalancerSourceRanges" in m and "default/web" in m for m in d.skipped)
    assert "'bogus'" in d.skipped[0] and "'10.0.0.0/33'" in d.skipped[1]


def test_source_ranges_allow_the_lb_ips_when_the_node_is_inside_a_range():
    s = svc(type_="LoadBalancer", status=LB_STATUS, loadBalancerSourceRanges=["192.168.0.0/24", "172.16.0.0/12"])
    assert one([s], []).source_ranges == ("192.168.0.0/24", "172.16.0.0/12", "198.51.100.1/32", "198.51.100.2/32")
    outside = NodeContext("node-a", ip="10.9.9.9")
    assert one([s], [], outside).source_ranges == ("192.168.0.0/24", "172.16.0.0/12")
    assert one([s], [], NodeContext("node-a")).source_ranges == ("192.168.0.0/24", "172.16.0.0/12")


def test_source_ranges_with_a_zero_prefix_or_without_lb_ips_are_dropped():
    zero = svc(type_="LoadBalancer", status=LB_STATUS, loadBalancerSourceRanges=["10.0.0.0/8", "1.2.3.4/0"])
    assert one([zero], []).source_ranges == ()
    v6_zero = svc(type_="LoadBalancer", status=LB_STATUS, loadBalancerSourceRanges=["10.0.0.0/8", "::/0"])
    assert one([v6_zero], []).source_ranges == ("10.0.0.0/8",)   # the other family's business
    no_ips = svc(type_="LoadBalancer", loadBalancerSourceRanges=["10.0.0.0/8"])
    assert one([no_ips], []).source_ranges == ()


# --- health-check node port -----------------------------------------------------------

def test_health_check_counts_unique_local_ready_ips_over_all_ports():
    s = svc(type_="LoadBalancer", ports=(("http", 80, "TCP"), ("https", 443, "TCP")), node_ports=(30080, 30443),
            externalTrafficPolicy="Local", healthCheckNodePort=32000)
    slices = [eps("a", endpoints=[ep("10.0.0.1", READY, node="node-a"), ep("10.0.0.2", READY, node="node-b"),
                                  ep("10.0.0.3", TERMINATING, node="node-a"), ep("10.0.0.4", NOT_READY, node="node-a")],
                  ports=(("http", 8080, "TCP"), ("https", 8443, "TCP"))),
              eps("b", endpoints=[ep("10.0.0.5", READY, node="node-a")], ports=(("metrics", 9090, "TCP"),))]
    # 10.0.0.1 counts once for its two ports; a slice port the Service lacks still counts
    assert desired([s], slices).health_checks == {("default/web", "IPv4"): (32000, 2)}
    assert desired([s], []).health_checks == {("default/web", "IPv4"): (32000, 0)}


def test_health_check_only_for_load_balancers_with_external_policy_local_and_a_port():
    hc = {"externalTrafficPolicy": "Local", "healthCheckNodePort": 32000}
    assert desired([svc(type_="NodePort", node_ports=(30080,), **hc)], []).health_checks == {}
    assert desired([svc(type_="LoadBalancer", externalTrafficPolicy="Cluster", healthCheckNodePort=32000)],
                   []).health_checks == {}
    assert desired([svc(type_="LoadBalancer", externalTrafficPolicy="Local")], []).health_checks == {}
    assert desired([svc(type_="LoadBalancer", **hc)], []).health_checks == {("default/web", "IPv4"): (32000, 0)}


# --- NodePort addresses (kube-proxy's nodePortAddresses) ------------------------------

LOCAL_ADDRS = ["127.0.0.1", "192.168.0.10", "192.168.0.11", "10.1.0.10", "::1", "fd00:192::10", "fd00:192::11",
               "fe80::1"]


def nodeports(items, node_ips=("192.168.0.11", "fd00:192::10")):
    from kxlb.controller.node import nodeport_selection, select_nodeport_addresses
    return select_nodeport_addresses(nodeport_selection(items, node_ips), LOCAL_ADDRS)


def test_primary_nodeports_are_the_node_ip_of_each_family_not_every_internal_ip():
    assert nodeports(()) == nodeports(("primary",)) == ("192.168.0.11", "fd00:192::10")
    # a node IP no interface holds serves nothing (kube-proxy's GetNodeIPs reads interfaces)
    assert nodeports(("primary",), ("192.168.0.99", "fd00:192::10")) == ("fd00:192::10",)


def test_a_family_without_cidrs_is_served_on_every_address_of_it_loopback_only_when_asked():
    # kube-proxy's NewNodePortAddresses: no IPv6 CIDR given, ::/0 (not ::1: loopback NodePorts
    # only when a CIDR aims at loopback)
    assert nodeports(("192.168.0.0/24",)) == ("192.168.0.10", "192.168.0.11", "fd00:192::10", "fd00:192::11",
                                              "fe80::1")
    assert nodeports(("primary",), ("192.168.0.11",)) == ("192.168.0.11", "fd00:192::10", "fd00:192::11", "fe80::1")
    assert nodeports(("all",)) == ("10.1.0.10", "192.168.0.10", "192.168.0.11", "fd00:192::10", "fd00:192::11",
                                   "fe80::1")
    assert nodeports(("all", "127.0.0.0/8")) == ("10.1.0.10", "127.0.0.1", "192.168.0.10", "192.168.0.11",
                                                 "fd00:192::10", "fd00:192::11", "fe80::1")
    assert nodeports(("localhost",)) == ("127.0.0.1", "::1")
    assert nodeports(("primary", "10.0.0.0/8", "fd00:192::11/128")) == ("10.1.0.10", "192.168.0.11", "fd00:192::10",
                                                                       "fd00:192::11")


def test_health_checks_are_per_family_with_that_familys_local_endpoints():
    s = svc(type_="LoadBalancer", node_ports=(30080,), externalTrafficPolicy="Local", healthCheckNodePort=32000,
            ips=("10.96.0.10", "fd00:96::10"))
    slices = [eps("a", endpoints=[ep("10.0.0.1", READY, node="node-a"), ep("10.0.0.2", READY, node="node-a")]),
              eps("b6", endpoints=[ep("fd00:10::1", READY, node="node-a"), ep("fd00:10::2", NOT_READY, node="node-a")],
                  atype="IPv6")]
    assert desired([s], slices, NODE_DUAL).health_checks == {("default/web", "IPv4"): (32000, 2),
                                                              ("default/web", "IPv6"): (32000, 1)}
