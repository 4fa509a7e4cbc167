"""The change tracker (controller/tracker.py), kernel-free: which Services a sync must
model again, with their slices, and the trigger times of the slice changes."""
from __future__ import annotations

from kxlb.controller.tracker import ChangeTracker

T0 = "2026-11-26T10:00:00Z"


def service(name: str, vip: str = "10.96.0.10") -> dict:
    return {"metadata": {"namespace": "d", "name": name},
            "spec": {"clusterIPs": [vip], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def slice_(name: str, svc: str, ip: str, trigger: str | None = T0) -> dict:
    md = {"namespace": "d", "name": name, "labels": {"kubernetes.io/service-name": svc}}
    if trigger:
        md["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": trigger}
    return {"metadata": md, "addressType": "IPv4", "endpoints": [{"addresses": [ip]}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


def ips(work) -> dict[str, list[str]]:
    return {w.service_id: sorted(e.address for s in w.slices for e in s.endpoints) for w in work}


def test_checkout_hands_each_changed_service_once_with_its_slices():
    t = ChangeTracker()
    t.service("ADDED", "d/a", service("a"))
    t.slice("ADDED", "d/a-1", slice_("a-1", "a", "10.0.0.1"))
    t.slice("ADDED", "d/a-2", slice_("a-2", "a", "10.0.0.2"))
    assert (t.pending, t.slice_changes) == (1, 2)
    work, triggers = t.checkout(full=False)
    assert ips(work) == {"d/a": ["10.0.0.1", "10.0.0.2"]} and len(triggers) == 2   # one per slice change
    assert t.checkout(full=False) == ([], []) and t.slice_changes == 0
    # a full checkout: every Service, and what the caller still holds (a fragment to drop)
    work, _ = t.checkout(full=True, also=["d/gone"])
    assert {w.service_id: w.service is not None for w in work} == {"d/a": True, "d/gone": False}


def test_a_slice_moving_to_another_service_dirties_both_and_a_deleted_one_drops_its_samples():
    t = ChangeTracker()
    t.slice("ADDED", "d/s-1", slice_("s-1", "a", "10.0.0.1"))
    t.checkout(full=False)
    t.slice("MODIFIED", "d/s-1", slice_("s-1", "b", "10.0.0.1"))
    work, triggers = t.checkout(full=False)
    assert ips(work) == {"d/a": [], "d/b": ["10.0.0.1"]} and len(triggers) == 1
    t.slice("MODIFIED", "d/s-1", slice_("s-1", "b", "10.0.0.2"))
    t.slice("DELETED", "d/s-1", slice_("s-1", "b", "10.0.0.2"))
    work, triggers = t.checkout(full=False)
    assert ips(work) == {"d/b": []} and triggers == []


def test_a_bad_object_keeps_the_last_good_version_and_is_reported():
    bad = []
    t = ChangeTracker(on_invalid=lambda exc, obj: bad.append(exc.field))
    t.service("ADDED", "d/a", service("a"))
    t.slice("ADDED", "d/a-1", slice_("a-1", "a", "10.0.0.1"))
    t.checkout(full=False)
    assert not t.service("MODIFIED", "d/a", service("a", vip="10.96.0.300"))
    assert not t.slice("MODIFIED", "d/a-1", {"metadata": {"namespace": "d", "name": "a-1"}})
    # an endpoint it cannot use is left out, the rest of the slice kept
    assert t.slice("MODIFIED", "d/a-2", {**slice_("a-2", "a", "10.0.0.2"),
                                         "endpoints": [{"addresses": ["nope"]}, {"addresses": ["10.0.0.3"]}]})
    assert bad == ["spec.clusterIPs[0]", "metadata.labels[kubernetes.io/service-name]", "endpoints[0].addresses[0]"]
    work, _ = t.checkout(full=False)
    assert ips(work) == {"d/a": ["10.0.0.1", "10.0.0.3"]} and work[0].service.cluster_ips == ("10.96.0.10",)


def test_the_datapath_config_is_the_node_ips_the_masquerade_address_and_every_service_cidr():
    from kxlb.controller.dpconfig import datapath_config

    many = [f"10.{100 + i}.0.0/16" for i in range(6)]   # more than struct lb_config holds
    cfg = datapath_config(("192.168.0.10", "fd00::10"), "fd00::99", ("10.244.0.0/16",),
                          many[::-1] + ["fd00:96::/108", many[0]], masquerade_all=False, src_ports=(20000, 29999))
    assert cfg.node_addrs == ("192.168.0.10", "fd00::10")
    assert cfg.snat_addrs == ("192.168.0.10", "fd00::99")   # --masquerade-address replaces its family's
    assert cfg.service_cidrs == tuple(many) + ("fd00:96::/108",) and cfg.src_ports == (20000, 29999)
    cfg = datapath_config((None, None), None, (), (), masquerade_all=True, src_ports=None)
    assert (cfg.snat_addrs, cfg.node_addrs, cfg.masquerade_all, cfg.src_ports) == ((), (), True, None)

    cfg = datapath_config(("192.168.0.10", "2001:db8::7"), None, (), (), False, None,
                          not_held=frozenset({"2001:db8::7"}))
    assert cfg.snat_addrs == ("192.168.0.10",) and cfg.node_addrs == ("192.168.0.10", "2001:db8::7")
