"""The sync loop never dies silently, and health tells the truth meanwhile (issue 9).

The runner and the health logic are tested on their own (pure, a fake clock where time
matters); then a Controller runs in-process against the real API server and real pinned
maps while map writes are made to fail, a malformed Service arrives and the Node turns
IPv6-first and gets the autoscaler's deletion taint.
"""
from __future__ import annotations

import errno
import threading
import time

import pytest

from conftest import NODE_IP, READY, backend_ips, make_service
from kxlb.controller.controller import Controller, ControllerConfig
from kxlb.controller.health import TO_BE_DELETED_TAINT, ProxyHealth
from kxlb.controller.runner import BoundedFrequencyRunner
from kxlb.loader.compile import compile_datapath
from kxlb.loader.layout import ServiceKey
from kxlb.loader.maps import Maps


def wait(cond, timeout=10.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout}s")


# --- the runner ---------------------------------------------------------------------------

def test_a_failing_run_is_retried_with_backoff_and_never_kills_the_loop():
    calls, errors = [], []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise RuntimeError(f"boom {len(calls)}")

    r = BoundedFrequencyRunner("t", fn, min_interval=0.0, max_interval=60, retry_initial=0.1, retry_max=1,
                               on_error=errors.append).start()
    try:
        wait(lambda: len(calls) >= 4, what="4 runs")
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        assert [str(e) for e in errors] == ["boom 1", "boom 2", "boom 3"]
        assert 0.09 <= gaps[0] < 0.5 and 0.19 <= gaps[1] < 0.7 and 0.39 <= gaps[2] < 1.0, gaps  # doubling
        assert r.failures == 0 and r.alive
        time.sleep(0.3)
        assert len(calls) == 4  # healthy again: next run only when asked (or max_interval)
    finally:
        r.stop()


def test_requests_during_the_cool_down_coalesce_into_one_run():
    calls = []
    r = BoundedFrequencyRunner("t", lambda: calls.append(1), min_interval=0.5, max_interval=60).start()
    try:
        wait(lambda: len(calls) == 1)
        for _ in range(20):
            r.run()
        time.sleep(0.2)
        assert len(calls) == 1          # still cooling down
        wait(lambda: len(calls) == 2)   # then one run for all 20 requests
        time.sleep(0.7)
        assert len(calls) == 2
    finally:
        r.stop()


# --- health -----------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_health_turns_503_when_a_change_waits_longer_than_the_timeout():
    clock = Clock()
    h = ProxyHealth(health_timeout=60, clock=clock)
    h.set_node({"metadata": {"name": "n"}})
    h.queued_update()
    clock.t += 3600  # starting: changes queued before the sync loop runs do not count
    assert h.answer("/livez")[0] == 200 and h.answer("/healthz")[0] == 200
    h.updated()      # the sync loop starts
    h.queued_update()
    clock.t += 59
    assert h.answer("/livez")[0] == 200
    clock.t += 2
    code, body = h.answer("/livez")
    assert code == 503 and body["healthy"] is False
    h.updated()
    code, body = h.answer("/healthz")
    assert code == 200 and body["healthy"] is True and body["nodeEligible"] is True
    assert body["status"]["IPv4"]["healthy"] is True


@pytest.mark.parametrize("node", [None, {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}},
                                  {"metadata": {}, "spec": {"taints": [{"key": TO_BE_DELETED_TAINT}]}}],
                         ids=["no node", "node deleting", "autoscaler taint"])
def test_healthz_is_503_for_a_node_going_away_but_livez_is_not(node):
    h = ProxyHealth(health_timeout=60)
    h.set_node(node)
    code, body = h.answer("/healthz")
    assert code == 503 and body["nodeEligible"] is False
    assert h.answer("/livez")[0] == 200


# --- the controller under injected failures --------------------------------------------------

@pytest.fixture
def inproc(cp, api, lab, ns):
    """A Controller in this process (real API server, real pinned maps)."""
    compile_datapath(lab.pin_dir)
    maps = Maps.open(lab.pin_dir)
    ctl = Controller(api, maps, ControllerConfig(node_name="lab-node", reconcile_period=1.0, full_sync_period=1.0,
                                                 retry_initial=0.1, healthcheck_servers=False))
    ctl.start()
    wait(ctl.metrics.ready.is_set, 30, "first sync")
    yield ctl
    ctl.stop()
    maps.close()


def programmed(ctl, key) -> tuple:
    return ctl.programmer.table.read_backends(key) or ()


def test_refused_map_writes_are_retried_and_health_tells_the_truth(api, ns, lab, inproc):
    ctl = inproc
    real = ctl.maps.backends.put_many_raw
    refusals = threading.Semaphore(0)

    def refuse(*a, **kw):  # the kernel says ENOMEM until the test lets it through
        if not refusals.acquire(blocking=False):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(*a, **kw)

    ctl.maps.backends.put_many_raw = refuse
    failures0 = ctl.metrics.sync_failures._value.get()
    svc = make_service(api, ns, "web", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    key = ServiceKey(svc["spec"]["clusterIP"], 80, 6)
    wait(lambda: ctl.metrics.sync_failures._value.get() >= failures0 + 2, 10, "failed syncs counted")
    assert programmed(ctl, key) == () and ctl.runner.alive
    # A change has waited more than twice the sync period (2 s): unhealthy, truthfully.
    wait(lambda: ctl.health.answer("/livez")[0] == 503, 10, "/livez 503")
    for _ in range(1000):
        refusals.release()
    wait(lambda: len(programmed(ctl, key)) == 3, 10, "service programmed after the retries")
    assert {b.addr for b in programmed(ctl, key)} == set(backend_ips(lab))
    wait(lambda: ctl.health.answer("/livez")[0] == 200, 10, "/livez 200 again")


def test_an_ipv6_first_node_is_served_and_a_node_going_away_drains_healthz(api, ns, lab, inproc):
    from kubernetes import client

    ctl = inproc
    core = client.CoreV1Api(api)
    ok = make_service(api, ns, "ok", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    # A Node whose first InternalIP is IPv6: served with its IPv4 one, not fatal.
    core.patch_node_status("lab-node", {"status": {"addresses": [{"type": "InternalIP", "address": "fd00::1"},
                                                                 {"type": "InternalIP", "address": NODE_IP}]}})
    # (Leading-zero addresses: the v1.37 API server refuses them in new objects; the
    # decoder's lenient parsing of old ones is tested in test_decode.py.)
    wait(lambda: len(programmed(ctl, ServiceKey(ok["spec"]["clusterIP"], 80, 6))) == 3, 10, "ok programmed")
    wait(lambda: ctl.programmer.table.read_config().snat_addrs == (NODE_IP,), 10, "IPv4 InternalIP used")
    assert ctl.runner.failures == 0 and ctl.health.answer("/healthz")[0] == 200
    core.patch_node("lab-node", {"spec": {"taints": [{"key": TO_BE_DELETED_TAINT, "effect": "NoSchedule"}]}})
    try:
        wait(lambda: ctl.health.answer("/healthz")[0] == 503, 10, "/healthz 503 for a node being removed")
        assert ctl.health.answer("/livez")[0] == 200
    finally:
        core.patch_node("lab-node", {"spec": {"taints": None}})
        core.patch_node_status("lab-node", {"status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}})
    wait(lambda: ctl.health.answer("/healthz")[0] == 200, 10, "/healthz 200 again")


def test_detect_local_node_cidr_takes_the_nodes_pod_cidr(cp, api, lab, ns):
    """detectLocalMode NodeCIDR: pods are the Node's spec.podCIDR (set by the kubelet or
    the node IPAM controller; once set it cannot change)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    node = core.read_node("lab-node")
    if not node.spec.pod_cidr:
        core.patch_node("lab-node", {"spec": {"podCIDR": "10.244.7.0/24", "podCIDRs": ["10.244.7.0/24"]}})
    want = core.read_node("lab-node").spec.pod_cidr
    compile_datapath(lab.pin_dir)
    maps = Maps.open(lab.pin_dir)
    ctl = Controller(api, maps, ControllerConfig(node_name="lab-node", reconcile_period=1.0, full_sync_period=1.0,
                                                 cluster_cidrs=("10.0.0.0/8",),
                                                 detect_local_node_cidr=True, healthcheck_servers=False))
    ctl.start()
    try:
        wait(lambda: ctl.programmer.table.read_config().cluster_cidrs == (want,), 15, f"detect-local {want}")
    finally:
        ctl.stop()
        maps.close()


def test_network_programming_latency_is_one_sample_per_slice_change(lab):
    """kube-proxy's tracker records the trigger time of every EndpointSlice change of a
    Service, and a sync observes each: two slices changed before one sync are two samples
    (and a slice deleted meanwhile drops the Service's pending ones)."""
    import datetime as dt

    compile_datapath(lab.pin_dir)
    maps = Maps.open(lab.pin_dir)
    ctl = Controller(None, maps, ControllerConfig(node_name="lab-node", min_sync_period=3.0, reconcile_period=30.0,
                                                  healthcheck_servers=False))
    hist = ctl.metrics.network_programming
    count = lambda: sum(s.value for s in next(iter(hist.collect())).samples if s.name.endswith("_count"))  # noqa: E731
    ctl.start()
    try:
        wait(ctl.metrics.ready.is_set, 30, "first sync")
        now = dt.datetime.now(dt.timezone.utc).isoformat()
        svc = {"metadata": {"namespace": "t", "name": "web"},
               "spec": {"clusterIPs": ["10.96.77.7"], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}

        def slice_(name: str, ip: str) -> dict:
            return {"metadata": {"namespace": "t", "name": name, "labels": {"kubernetes.io/service-name": "web"},
                                 "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": now}},
                    "addressType": "IPv4", "endpoints": [{"addresses": [ip]}],
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}
        before = count()
        ctl.on_service("ADDED", "t/web", svc)
        ctl.on_slice("ADDED", "t/web-1", slice_("web-1", "10.1.7.1"))
        ctl.on_slice("ADDED", "t/web-2", slice_("web-2", "10.1.7.2"))   # within min_sync_period: one sync
        key = ServiceKey("10.96.77.7", 80, 6)
        wait(lambda: len(programmed(ctl, key)) == 2, 15, "both slices programmed")
        assert count() - before == 2
        ctl.on_slice("MODIFIED", "t/web-1", slice_("web-1", "10.1.7.3"))
        ctl.on_slice("DELETED", "t/web-2", slice_("web-2", "10.1.7.2"))
        wait(lambda: [str(b) for b in programmed(ctl, key)] == ["10.1.7.3:8080"], 15, "the change programmed")
        assert count() - before == 2
    finally:
        ctl.stop()
        maps.close()


def test_the_drift_check_is_spread_over_the_full_sync_period_and_still_repairs(cp, api, lab, ns):
    """kube-proxy's hourly full resync, as kxlb does it: every service port is read back
    once a full-sync period, a share per run (controller/sweep.py), so no run holds changes
    back for a read of every map. 40 service ports, a period of 4 s, runs every 0.25 s:
    runs check a few each, every one is checked within the period, and an edit behind the
    controller's back is repaired in the cycle that reaches it."""
    from kxlb.loader.layout import Backend
    from kxlb.loader.services import ServiceTable

    keys = [ServiceKey(make_service(api, ns, f"d{i}", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
                       ["spec"]["clusterIP"], 80, 6) for i in range(40)]
    compile_datapath(lab.pin_dir)
    maps = Maps.open(lab.pin_dir)
    ctl = Controller(api, maps, ControllerConfig(node_name="lab-node", reconcile_period=0.25, full_sync_period=4.0,
                                                 healthcheck_servers=False))
    checked: list[list[ServiceKey]] = []
    real = ctl.programmer.drift

    def drift(keys_, entries):
        checked.append(list(keys_))
        return real(keys_, entries)
    ctl.programmer.drift = drift
    ctl.start()
    try:
        wait(lambda: all(programmed(ctl, k) for k in keys), 30, "every service port programmed")
        # The first sync read everything: the next cycle starts 4 s later.
        wait(lambda: set(keys) <= {k for part in checked for k in part}, 15, "every service port read back")
        shares = [len(part) for part in checked if part]
        assert max(shares) <= 20 and len(shares) >= 6   # in many small shares, never all at once
        repaired = ctl.metrics.drift_repaired._value.get()
        with Maps.open(lab.pin_dir) as other:          # another tool, behind its back
            ServiceTable(other).set_backends(keys[7], [Backend("10.9.9.9", 1)])
        assert [str(b.addr) for b in programmed(ctl, keys[7])] == ["10.9.9.9"]
        wait(lambda: sorted(b.addr for b in programmed(ctl, keys[7])) == sorted(backend_ips(lab)), 12,
             "the edit repaired within a cycle or two")
        wait(lambda: ctl.metrics.drift_repaired._value.get() >= repaired + 1, 5, "the repair counted")
    finally:
        ctl.stop()
        maps.close()
