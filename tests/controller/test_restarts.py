"""Restarts never disturb traffic: the API server dies mid-watch, the watch falls behind
etcd's compaction (410 Gone), the controller is SIGKILLed under load."""
from __future__ import annotations

import base64
import json
import signal
import threading
import time
import urllib.request

from conftest import BACKEND_PORT, READY, backend_ips, make_service, put_slice, read_maps, wait_maps
from kxlb.lab.client import backends_answering, tcp_connect, tcp_exchange, tcp_request
from kxlb.lab.controlplane import APISERVER
from kxlb.loader.maps import Maps


def svc_ids(lab) -> dict[str, int]:
    from kxlb.loader.services import ServiceTable

    with Maps.open(lab.pin_dir) as maps:
        return {str(k): s.svc_id for k, s in ServiceTable(maps).read_all().items()}


def etcd_compact(cp) -> int:
    """Compact etcd at its current revision (its JSON gateway); returns the revision."""
    def post(path, body):
        req = urllib.request.Request(f"{cp.etcd_url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    rev = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    post("/v3/kv/compaction", {"revision": rev, "physical": True})
    return rev


def restart_apiserver(cp, attempts: int = 5) -> None:
    """Start kube-apiserver again; the dead one's port can take a moment to be free."""
    from kxlb.lab.controlplane import ControlPlaneError

    for i in range(attempts):
        try:
            cp.restart(APISERVER)
            return
        except ControlPlaneError as exc:
            if "address already in use" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(1)


def test_apiserver_killed_mid_watch_then_back(api, ns, cp, lab, controller):
    svc = make_service(api, ns, "a", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:80/tcp", [])) == 3)
    before = controller.metric("kxlb_watch_restarts_total")
    cp.kill(APISERVER)
    try:
        # The datapath does not need the API server, nor the controller.
        want = {"be0", "be1", "be2"}
        assert backends_answering(lab.client, ip, 80, want) == want
        time.sleep(1)
    finally:
        restart_apiserver(cp)
    put_slice(api, ns, "a", [(lab.backend_ip(0), READY)], [("http", BACKEND_PORT, "TCP")])
    wait_maps(lab, lambda m: m.get(f"{ip}:80/tcp") == [f"{lab.backend_ip(0)}:{BACKEND_PORT}"], timeout=30)
    assert controller.metric("kxlb_watch_restarts_total") > before
    assert controller.proc.poll() is None


def test_watch_behind_compaction_relists_and_applies_only_the_difference(api, ns, cp, lab, controller):
    from kubernetes import client

    keep = make_service(api, ns, "keep", [("http", 80, "TCP")], [(lab.backend_ip(2), READY)])
    shrink = make_service(api, ns, "shrink", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    gone = make_service(api, ns, "gone", [("http", 80, "TCP")], [(lab.backend_ip(1), READY)])
    k_keep, k_shrink, k_gone = (f"{s['spec']['clusterIP']}:80/tcp" for s in (keep, shrink, gone))
    wait_maps(lab, lambda m: k_keep in m and len(m.get(k_shrink, [])) == 3 and k_gone in m)
    ids_before = svc_ids(lab)
    gone_before = controller.metric("kxlb_watch_restarts_total", reason="gone")
    controller.proc.send_signal(signal.SIGSTOP)  # frozen: its watches fall behind
    try:
        cp.kill(APISERVER)    # its watch connections break with nothing in flight
        restart_apiserver(cp)
        put_slice(api, ns, "shrink", [(lab.backend_ip(0), READY)], [("http", BACKEND_PORT, "TCP")])
        client.CoreV1Api(api).delete_namespaced_service("gone", ns)
        time.sleep(0.5)
        etcd_compact(cp)
        cp.kill(APISERVER)    # a fresh watch cache starts after the compaction:
        restart_apiserver(cp)  # the controller's resourceVersion is now too old
    finally:
        controller.proc.send_signal(signal.SIGCONT)
    m = wait_maps(lab, lambda m: m.get(k_shrink) == [f"{lab.backend_ip(0)}:{BACKEND_PORT}"] and k_gone not in m,
                  timeout=40, what="relist after 410")
    assert controller.metric("kxlb_watch_restarts_total", reason="gone") > gone_before
    assert svc_ids(lab)[k_keep] == ids_before[k_keep] and svc_ids(lab)[k_shrink] == ids_before[k_shrink]
    assert m[k_keep] == [f"{lab.backend_ip(2)}:{BACKEND_PORT}"]


def test_controller_sigkill_and_restart_under_traffic(api, ns, lab, controller):
    svc = make_service(api, ns, "busy", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    key = f"{ip}:80/tcp"
    wait_maps(lab, lambda m: len(m.get(key, [])) == 3)
    ids_before = svc_ids(lab)
    long_lived = tcp_connect(lab.client, ip, 80)
    owner = tcp_exchange(long_lived, "hello").split()[0]
    results = {"ok": 0, "failed": []}
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                tcp_request(lab.client, ip, 80, "ping")
                results["ok"] += 1
            except OSError as exc:
                results["failed"].append(repr(exc))

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(0.5)
        controller.kill(signal.SIGKILL)
        time.sleep(1.0)
        controller.start()   # adopts the pinned maps, applies only the difference
        time.sleep(1.0)
    finally:
        stop.set()
        t.join()
    with long_lived:
        assert tcp_exchange(long_lived, "still there?") == f"{owner} still there?"
    assert results["failed"] == [] and results["ok"] > 20, results
    assert svc_ids(lab)[key] == ids_before[key]  # not rewritten, let alone flushed


def test_edits_made_while_the_controller_was_down_are_repaired_before_ready(api, ns, lab, controller):
    """A restarted controller reads the maps once and writes the difference: that first
    sync is the drift repair (no second read of every map before ready). Restarted with
    a node's periods, so no periodic resync can do the repair instead."""
    import subprocess
    import sys

    from kxlb.loader.layout import SvcValue
    from kxlb.loader.services import MARKER, _marker_key

    svc = make_service(api, ns, "mended", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    key = f"{svc['spec']['clusterIP']}:80/tcp"
    want = sorted(f"{b}:{BACKEND_PORT}" for b in backend_ips(lab))
    wait_maps(lab, lambda m: m.get(key) == want)
    controller.kill(signal.SIGKILL)
    kxlb = [sys.executable, "-m", "kxlb", "--pin-dir", lab.pin_dir]
    subprocess.run(kxlb + ["service", "set-backends", key, "10.9.9.9:1"], check=True, capture_output=True)
    subprocess.run(kxlb + ["service", "add", "10.96.250.250:1/tcp", "10.9.9.9:1"], check=True, capture_output=True)
    with Maps.open(lab.pin_dir) as maps:  # what a writer killed between two writes leaves
        maps.services.put(_marker_key("10.96.250.251"), SvcValue(kind=MARKER))
    periods = controller.periods
    controller.periods = []
    try:
        controller.start()  # returns at /readyz 200
        now = read_maps(lab)
        assert now.get(key) == want and "10.96.250.250:1/tcp" not in now, now
        with Maps.open(lab.pin_dir) as maps:
            assert maps.services.get(_marker_key("10.96.250.251")) is None
    finally:
        controller.kill(signal.SIGTERM)
        controller.periods = periods
        controller.start()
