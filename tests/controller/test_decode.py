"""Raw API JSON -> model: every field read, malformed ones named. Pure: no cluster."""
from __future__ import annotations

import pytest

from kxlb.controller.decode import DecodeError, decode_service, decode_slice
from kxlb.controller.model import Endpoint, Service, ServicePort, SlicePort

MD = {"namespace": "d", "name": "web"}


def service(spec=None, status=None, **extra_spec) -> dict:
    obj = {"metadata": MD, "spec": {"clusterIPs": ["10.96.0.10"], "ports": [{"name": "http", "port": 80}],
                                    **(spec or {}), **extra_spec}}
    if status is not None:
        obj["status"] = status
    return obj


def slice_(endpoints=(), ports=({"name": "http", "port": 8080, "protocol": "TCP"},)) -> dict:
    return {"metadata": {"namespace": "d", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": list(endpoints), "ports": list(ports)}


def test_every_service_field_is_read():
    got = decode_service(service(
        {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80, "protocol": "UDP", "nodePort": 30080}],
         "externalIPs": ["203.0.113.5", "2001:db8::5"], "externalTrafficPolicy": "Local",
         "internalTrafficPolicy": "Local", "sessionAffinity": "ClientIP",
         "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
         "loadBalancerSourceRanges": [" 10.0.0.0/8 "], "trafficDistribution": "PreferClose",
         "healthCheckNodePort": 32000},
        status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "VIP"}, {"ip": "198.51.100.2"},
                                             {"hostname": "lb.example"}]}}))
    assert got == Service(
        namespace="d", name="web", type="LoadBalancer", cluster_ips=("10.96.0.10",),
        ports=(ServicePort("http", 80, "UDP", 30080),), external_ips=("203.0.113.5", "2001:db8::5"),
        lb_ingress=(("198.51.100.1", "VIP"), ("198.51.100.2", None)), lb_source_ranges=(" 10.0.0.0/8 ",),
        external_traffic_policy="Local", internal_traffic_policy="Local", session_affinity="ClientIP",
        affinity_timeout=60, traffic_distribution="PreferClose", health_check_node_port=32000)


def test_absent_service_fields_take_the_api_defaults():
    got = decode_service({"metadata": MD, "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}})
    assert got == Service(namespace="d", name="web", cluster_ips=("10.96.0.10",), ports=(ServicePort("", 80, "TCP"),))
    assert (got.type, got.external_traffic_policy, got.internal_traffic_policy, got.session_affinity,
            got.affinity_timeout, got.health_check_node_port, got.ports[0].node_port) == \
        ("ClusterIP", "Cluster", "Cluster", "None", 10800, 0, 0)
    # ClientIP without a config: the API's default timeout
    assert decode_service(service(sessionAffinity="ClientIP")).affinity_timeout == 10800


def test_unparsable_external_and_ingress_ips_are_skipped_and_sloppy_ones_normalised():
    got = decode_service(service(
        externalIPs=["nope", "", "010.000.000.005", 7, "::ffff:192.0.2.1"], clusterIPs=["010.096.000.010"],
        status={"loadBalancer": {"ingress": [{"ip": "bad", "ipMode": "VIP"}, {"ip": "198.051.100.001"}]}}))
    assert got.external_ips == ("10.0.0.5", "192.0.2.1")
    assert got.cluster_ips == ("10.96.0.10",)
    assert got.lb_ingress == (("198.51.100.1", None),)


@pytest.mark.parametrize("spec, status, field", [
    ({"clusterIPs": ["10.96.0.300"]}, None, "spec.clusterIPs[0]"),
    ({"ports": [{"port": 0}]}, None, "spec.ports[0].port"),
    ({"ports": [{"port": 80, "nodePort": "30080"}]}, None, "spec.ports[0].nodePort"),
    ({"ports": [{"port": 80}, {"port": 81, "nodePort": 70000}]}, None, "spec.ports[1].nodePort"),
    ({"healthCheckNodePort": -1}, None, "spec.healthCheckNodePort"),
    ({"healthCheckNodePort": True}, None, "spec.healthCheckNodePort"),
    ({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}, None,
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds"),
    ({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}}}, None,
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds"),
    ({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": "60"}}, None,
     "spec.sessionAffinityConfig.clientIP"),
    ({"externalTrafficPolicy": ["Local"]}, None, "spec.externalTrafficPolicy"),
    ({"internalTrafficPolicy": 1}, None, "spec.internalTrafficPolicy"),
    ({"trafficDistribution": ["PreferClose"]}, None, "spec.trafficDistribution"),
    ({"externalIPs": "203.0.113.5"}, None, "spec.externalIPs"),
    ({"loadBalancerSourceRanges": "10.0.0.0/8"}, None, "spec.loadBalancerSourceRanges"),
    ({"loadBalancerSourceRanges": ["10.0.0.0/8", 10]}, None, "spec.loadBalancerSourceRanges[1]"),
    ({}, {"loadBalancer": {"ingress": {"ip": "198.51.100.1"}}}, "status.loadBalancer.ingress"),
    ({}, {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": 1}]}}, "status.loadBalancer.ingress[0].ipMode"),
])
def test_malformed_service_names_object_and_field(spec, status, field):
    with pytest.raises(DecodeError) as err:
        decode_service(service(spec, status))
    assert err.value.field == field and "Service d/web" in str(err.value)


def test_affinity_config_is_not_read_without_client_ip_affinity():
    # kube-proxy reads the timeout only for ClientIP; a leftover config must not fail
    got = decode_service(service(sessionAffinity="None", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}))
    assert (got.session_affinity, got.affinity_timeout) == ("None", 10800)


def test_slice_hints_conditions_and_ports_are_read():
    got = decode_slice(slice_(
        [{"addresses": ["10.0.0.1"], "nodeName": "n1", "conditions": {"ready": False, "terminating": True},
          "hints": {"forZones": [{"name": "z1"}, {"name": "z2"}], "forNodes": [{"name": "n1"}]}},
         {"addresses": ["10.0.0.2"], "hints": {"forZones": [{"name": "z1"}]}},
         {"addresses": ["10.0.0.3"]}],
        ports=({"name": "http", "port": 8080, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"})))
    assert got.endpoints == (Endpoint("10.0.0.1", False, True, True, "n1", ("z1", "z2"), ("n1",)),
                             Endpoint("10.0.0.2", True, True, False, None, ("z1",), ()),
                             Endpoint("10.0.0.3"))
    # an absent name is not "": kube-proxy ignores that port
    assert got.ports == (SlicePort("http", 8080, "TCP"), SlicePort(None, 53, "UDP"))


@pytest.mark.parametrize("obj, field", [
    (slice_([{"addresses": ["nope"]}]), "endpoints[0].addresses[0]"),
    (slice_([{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.256"]}]), "endpoints[1].addresses[0]"),
    (slice_(ports=[{"port": 70000}]), "ports[0].port"),
    (slice_([{"addresses": ["10.0.0.1"], "hints": {"forZones": "z1"}}]), "endpoints[0].hints.forZones"),
    (slice_([{"addresses": ["10.0.0.1"], "hints": {"forNodes": [{"name": "n"}, "n2"]}}]),
     "endpoints[0].hints.forNodes"),
    ({"metadata": {"namespace": "d", "name": "web-1"}}, "metadata.labels[kubernetes.io/service-name]"),
])
def test_malformed_slice_names_object_and_field(obj, field):
    with pytest.raises(DecodeError) as err:
        decode_slice(obj)
    assert err.value.field == field and "EndpointSlice d/web-1" in str(err.value)


def test_a_bad_endpoint_or_port_is_left_out_and_reported_the_rest_of_the_slice_kept():
    """kube-proxy ignores an endpoint or port it cannot use; the controller passes a list
    and gets the others (a strict caller gets the error)."""
    obj = slice_([{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.256"]}, {"addresses": ["10.0.0.3"]}],
                 ports=[{"name": "a", "port": 0}, {"name": "b", "port": 8080}])
    skipped: list[DecodeError] = []
    got = decode_slice(obj, skipped)
    assert [e.address for e in got.endpoints] == ["10.0.0.1", "10.0.0.3"]
    assert got.ports == (SlicePort("b", 8080, "TCP"),)
    assert [(e.field, "EndpointSlice d/web-1" in str(e)) for e in skipped] == \
        [("endpoints[1].addresses[0]", True), ("ports[0].port", True)]
    with pytest.raises(DecodeError, match=r"endpoints\[1\].addresses\[0\]"):
        decode_slice(obj)


def test_a_dual_stack_node_gives_both_families_internal_ips_and_pod_cidrs():
    from kxlb.controller.node import decode_node

    node = decode_node({"metadata": {"name": "n1"},
                        "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"]},
                        "status": {"addresses": [{"type": "Hostname", "address": "n1"},
                                                 {"type": "InternalIP", "address": "FD00:192:0::10"},
                                                 {"type": "InternalIP", "address": "192.168.0.10"}]}})
    assert node.ips == ("fd00:192::10", "192.168.0.10")
    assert (node.first_ip(4), node.first_ip(6)) == ("192.168.0.10", "fd00:192::10")
    assert node.pod_cidrs == ("10.244.1.0/24", "fd00:10:244:1::/64")
    with pytest.raises(DecodeError, match=r"status.addresses\[0\].address"):
        decode_node({"metadata": {"name": "n1"}, "status": {"addresses": [{"type": "InternalIP", "address": "fd00::g"}]}})


def test_node_ips_are_kube_proxys_one_per_family_internal_before_external():
    """GetNodeHostIPs: InternalIPs then ExternalIPs; the first is the primary node IP, the
    first of the other family the second; a node without InternalIPs uses its ExternalIP."""
    from kxlb.controller.node import decode_node

    def ips(*addrs):
        return decode_node({"metadata": {"name": "n1"}, "status": {"addresses": [
            {"type": t, "address": a} for t, a in addrs]}}).ips
    assert ips(("InternalIP", "10.0.0.1"), ("InternalIP", "10.0.0.2"), ("InternalIP", "fd00::1"),
               ("InternalIP", "fd00::2")) == ("10.0.0.1", "fd00::1")
    assert ips(("ExternalIP", "203.0.113.7"), ("InternalIP", "fd00::1")) == ("fd00::1", "203.0.113.7")
    assert decode_node({"metadata": {"name": "n1"}, "status": {"addresses": [
        {"type": "ExternalIP", "address": "203.0.113.7"}, {"type": "InternalIP", "address": "fd00::1"}]}}).external \
        == frozenset({"203.0.113.7"})
    assert ips(("ExternalIP", "203.0.113.7"), ("Hostname", "n1")) == ("203.0.113.7",)
    assert ips(("Hostname", "n1")) == ()
    with pytest.raises(DecodeError, match=r"status.addresses\[1\].address"):
        ips(("InternalIP", "10.0.0.1"), ("ExternalIP", "not-an-ip"))
    # the controller passes a list: the bad address is left out and reported, the rest used
    skipped: list[DecodeError] = []
    node = decode_node({"metadata": {"name": "n1"}, "status": {"addresses": [
        {"type": "InternalIP", "address": "10.0.0.300"}, {"type": "ExternalIP", "address": "203.0.113.7"}]}},
        skipped)
    assert node.ips == ("203.0.113.7",) and [e.field for e in skipped] == ["status.addresses[0].address"]


def test_ipv6_addresses_come_out_in_one_canonical_form():
    svc = decode_service({"metadata": {"namespace": "d", "name": "s"},
                          "spec": {"clusterIPs": ["FD00:96:0::10", "10.96.0.10"], "externalIPs": ["2001:DB8::1"],
                                   "ports": [{"port": 80}]}})
    assert svc.cluster_ips == ("fd00:96::10", "10.96.0.10") and svc.external_ips == ("2001:db8::1",)
    sl = decode_slice({"metadata": {"namespace": "d", "name": "s-1", "labels": {"kubernetes.io/service-name": "s"}},
                       "addressType": "IPv6", "endpoints": [{"addresses": ["FD00:244:0:0::5"]}], "ports": []})
    assert sl.endpoints[0].address == "fd00:244::5"
    with pytest.raises(DecodeError, match="is not an IPv6 address"):
        decode_slice({"metadata": {"namespace": "d", "name": "s-2", "labels": {"kubernetes.io/service-name": "s"}},
                      "addressType": "IPv6", "endpoints": [{"addresses": ["::ffff:10.0.0.1"]}], "ports": []})
