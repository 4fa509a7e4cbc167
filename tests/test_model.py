"""Desired state from Services and EndpointSlices: kube-proxy's rules, without a kernel."""
from __future__ import annotations

import pytest

from kxlb.controller.decode import DecodeError, decode_service, decode_slice
from kxlb.controller.model import desired_state
from kxlb.loader.layout import Backend, ServiceKey


def svc(name="web", ips=("10.96.0.10",), ports=(("http", 80, "TCP"),), type_="ClusterIP", ns="default"):
    return decode_service({"metadata": {"namespace": ns, "name": name},
                           "spec": {"type": type_, "clusterIPs": list(ips),
                                    "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports]}})


def eps(name, service="web", endpoints=(), ports=(("http", 8080, "TCP"),), atype="IPv4", ns="default"):
    return decode_slice({"metadata": {"namespace": ns, "name": name, "labels": {"kubernetes.io/service-name": service}},
                         "addressType": atype,
                         "endpoints": [{"addresses": [ip], "conditions": cond} for ip, cond in endpoints],
                         "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports]})


def state(services, slices):
    return desired_state({s.id: s for s in services}, {f"{s.namespace}/{s.name}": s for s in slices}).services


READY = {"ready": True, "serving": True, "terminating": False}
TERMINATING = {"ready": False, "serving": True, "terminating": True}
NOT_READY = {"ready": False, "serving": False, "terminating": False}
KEY = ServiceKey("10.96.0.10", 80, 6)


def test_ready_endpoints_of_all_slices_are_merged_in_a_stable_order():
    got = state([svc()], [eps("a", endpoints=[("10.0.0.12", READY), ("10.0.0.3", NOT_READY)]),
                          eps("b", endpoints=[("10.0.0.2", READY)])])
    assert got == {KEY: (Backend("10.0.0.2", 8080), Backend("10.0.0.12", 8080))}


def test_terminating_endpoints_only_when_none_is_ready():
    only_terminating = state([svc()], [eps("a", endpoints=[("10.0.0.5", TERMINATING), ("10.0.0.6", NOT_READY)])])
    assert only_terminating == {KEY: (Backend("10.0.0.5", 8080),)}
    mixed = state([svc()], [eps("a", endpoints=[("10.0.0.5", TERMINATING), ("10.0.0.7", READY)])])
    assert mixed == {KEY: (Backend("10.0.0.7", 8080),)}


def test_absent_conditions_mean_ready():
    assert state([svc()], [eps("a", endpoints=[("10.0.0.8", {})])]) == {KEY: (Backend("10.0.0.8", 8080),)}


def test_same_address_in_two_slices_non_terminating_wins():
    got = state([svc()], [eps("a", endpoints=[("10.0.0.9", {"ready": False, "serving": True, "terminating": True})]),
                          eps("b", endpoints=[("10.0.0.9", READY)])])
    assert got == {KEY: (Backend("10.0.0.9", 8080),)}


def test_named_target_port_resolves_per_slice_and_multi_port():
    s = svc(ports=(("http", 80, "TCP"), ("dns", 53, "UDP")))
    got = state([s], [eps("a", endpoints=[("10.0.0.2", READY)], ports=(("http", 8080, "TCP"), ("dns", 5353, "UDP"))),
                      eps("b", endpoints=[("10.0.0.3", READY)], ports=(("http", 9090, "TCP"),))])
    assert got == {KEY: (Backend("10.0.0.2", 8080), Backend("10.0.0.3", 9090)),
                   ServiceKey("10.96.0.10", 53, 17): (Backend("10.0.0.2", 5353),)}


def test_no_endpoints_is_a_service_with_no_backend():
    assert state([svc()], []) == {KEY: ()}


def test_headless_external_name_ipv6_and_other_services_slices_are_ignored():
    services = [svc("headless", ips=("None",)), svc("ext", ips=(), type_="ExternalName"),
                svc("v6", ips=("fd00::10",))]
    assert state(services, [eps("x", service="headless", endpoints=[("10.0.0.2", READY)])]) == {}
    dual = svc(ips=("10.96.0.10", "fd00::10"))
    got = state([dual], [eps("a", endpoints=[("10.0.0.2", READY)]),
                         eps("b", endpoints=[("fd00::2", READY)], atype="IPv6"),
                         eps("c", service="other", endpoints=[("10.0.0.99", READY)])])
    assert got == {KEY: (Backend("10.0.0.2", 8080),)}


def test_sctp_port_is_skipped_with_a_reason():
    d = desired_state({"default/web": svc(ports=(("s", 99, "SCTP"), ("http", 80, "TCP")))}, {})
    assert set(d.services) == {KEY} and "SCTP" in d.skipped[0] and "default/web" in d.skipped[0]


@pytest.mark.parametrize("obj, field", [
    ({"metadata": {"namespace": "d", "name": "bad"}, "spec": {"clusterIPs": ["10.96.0.300"]}}, "spec.clusterIPs[0]"),
    ({"metadata": {"namespace": "d", "name": "bad"}, "spec": {"clusterIPs": ["10.96.0.1"], "ports": [{"port": 0}]}},
     "spec.ports[0].port"),
])
def test_bad_service_names_object_and_field(obj, field):
    with pytest.raises(DecodeError) as err:
        decode_service(obj)
    assert err.value.field == field and "Service d/bad" in str(err.value)


@pytest.mark.parametrize("obj, field", [
    ({"metadata": {"namespace": "d", "name": "s1", "labels": {"kubernetes.io/service-name": "web"}},
      "endpoints": [{"addresses": ["nope"]}]}, "endpoints[0].addresses[0]"),
    ({"metadata": {"namespace": "d", "name": "s1", "labels": {"kubernetes.io/service-name": "web"}},
      "ports": [{"port": 70000}]}, "ports[0].port"),
    ({"metadata": {"namespace": "d", "name": "s1"}}, "metadata.labels[kubernetes.io/service-name]"),
])
def test_bad_slice_names_object_and_field(obj, field):
    with pytest.raises(DecodeError) as err:
        decode_slice(obj)
    assert err.value.field == field and "EndpointSlice d/s1" in str(err.value)
