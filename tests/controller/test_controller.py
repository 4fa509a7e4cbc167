"""`kxlb controller` against a real API server: the maps follow the cluster, traffic
follows the maps, and nothing that restarts (API server, controller) disturbs traffic."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import (BACKEND_PORT, DRAINING, READY, backend_ips, http_get, make_service, put_slice, wait_maps)
from kxlb.lab.client import backends_answering, tcp_request, udp_connect, udp_request
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable


def names_over(lab, ip, port, n):
    return {tcp_request(lab.client, ip, port)[0].split()[0] for _ in range(n)}


def test_services_and_slices_become_maps_and_traffic(api, ns, lab, controller):
    svc = make_service(api, ns, "web", [("http", 80, "TCP"), ("dns", 53, "UDP")],
                       [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    want = sorted(f"{b}:{BACKEND_PORT}" for b in backend_ips(lab))
    wait_maps(lab, lambda m: m.get(f"{ip}:80/tcp") == want and m.get(f"{ip}:53/udp") == want)
    assert backends_answering(lab.client, ip, 80, {"be0", "be1", "be2"}) == {"be0", "be1", "be2"}
    reply, src = udp_request(lab.client, ip, 53, "q")
    assert src == (ip, 53) and reply.split()[0] in {"be0", "be1", "be2"}


def test_scaling_down_and_deleting_follow(api, ns, lab, controller):
    from kubernetes import client

    svc = make_service(api, ns, "scale", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:80/tcp", [])) == 3)
    put_slice(api, ns, "scale", [(lab.backend_ip(1), READY)], [("http", BACKEND_PORT, "TCP")])
    wait_maps(lab, lambda m: m.get(f"{ip}:80/tcp") == [f"{lab.backend_ip(1)}:{BACKEND_PORT}"])
    assert names_over(lab, ip, 80, 10) == {"be1"}
    client.CoreV1Api(api).delete_namespaced_service("scale", ns)
    wait_maps(lab, lambda m: f"{ip}:80/tcp" not in m)
    with pytest.raises(OSError):
        tcp_request(lab.client, ip, 80)


def test_terminating_endpoints_serve_only_when_none_is_ready(api, ns, lab, controller):
    term = {"ready": False, "serving": True, "terminating": True}
    svc = make_service(api, ns, "term", [("http", 80, "TCP")],
                       [(lab.backend_ip(0), term), (lab.backend_ip(1), READY)])
    ip = svc["spec"]["clusterIP"]
    key = f"{ip}:80/tcp"
    wait_maps(lab, lambda m: m.get(key) == [f"{lab.backend_ip(1)}:{BACKEND_PORT}"])
    put_slice(api, ns, "term", [(lab.backend_ip(0), term), (lab.backend_ip(1), {"ready": False, "serving": False,
                                                                                 "terminating": True})],
              [("http", BACKEND_PORT, "TCP")])
    wait_maps(lab, lambda m: m.get(key) == [f"{lab.backend_ip(0)}:{BACKEND_PORT}"])
    assert names_over(lab, ip, 80, 5) == {"be0"}


def test_named_target_port_resolves_per_slice(api, ns, lab, controller):
    svc = make_service(api, ns, "named", [("web", 80, "TCP")], [(lab.backend_ip(0), READY)],
                       slice_ports=[("web", BACKEND_PORT, "TCP")])
    put_slice(api, ns, "named", [(lab.backend_ip(1), READY)], [("web", 9999, "TCP")], slice_name="named-2")
    key = f"{svc['spec']['clusterIP']}:80/tcp"
    wait_maps(lab, lambda m: m.get(key) == [f"{lab.backend_ip(0)}:{BACKEND_PORT}", f"{lab.backend_ip(1)}:9999"])


def test_other_proxies_and_headless_services_are_left_alone(api, ns, lab, controller):
    other = make_service(api, ns, "other", [("http", 80, "TCP")], [(lab.backend_ip(0), READY)],
                         labels={"service.kubernetes.io/service-proxy-name": "someone-else"})
    make_service(api, ns, "headless", [("http", 80, "TCP")], [(lab.backend_ip(0), READY)], cluster_ip="None")
    mine = make_service(api, ns, "mine", [("http", 80, "TCP")], [(lab.backend_ip(0), READY)])
    m = wait_maps(lab, lambda m: f"{mine['spec']['clusterIP']}:80/tcp" in m)
    assert f"{other['spec']['clusterIP']}:80/tcp" not in m
    assert not any(k.startswith("None") for k in m)


def test_drift_in_the_maps_is_repaired_and_counted(api, ns, lab, controller):
    svc = make_service(api, ns, "drift", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    key = f"{svc['spec']['clusterIP']}:80/tcp"
    want = sorted(f"{b}:{BACKEND_PORT}" for b in backend_ips(lab))
    wait_maps(lab, lambda m: m.get(key) == want)
    before = controller.metric("kxlb_drift_repaired_total")
    # The controller owns the maps while it runs: the CLI is refused at once, naming it ...
    kxlb = [sys.executable, "-m", "kxlb", "--pin-dir", lab.pin_dir]
    r = subprocess.run(kxlb + ["service", "set-backends", key, "10.9.9.9:1"], capture_output=True, text=True)
    assert r.returncode == 1 and "is written by the controller of node" in r.stderr, r.stderr
    # ... so the drift is made behind kxlb's back (another tool, bpftool): repaired all the same.
    def behind_its_back(change):
        with Maps.open(lab.pin_dir) as maps:
            change(ServiceTable(maps))
    behind_its_back(lambda t: t.set_backends(ServiceKey.parse(key), [Backend.parse("10.9.9.9:1")]))
    wait_maps(lab, lambda m: m.get(key) == want, what="altered entry repaired")
    behind_its_back(lambda t: t.delete(ServiceKey.parse(key)))
    wait_maps(lab, lambda m: m.get(key) == want, what="deleted entry repaired")
    behind_its_back(lambda t: t.add(ServiceKey.parse("10.96.250.250:1/tcp"), [Backend.parse("10.9.9.9:1")]))
    wait_maps(lab, lambda m: "10.96.250.250:1/tcp" not in m, what="foreign entry removed")
    # The counter follows the repair in the same sync, a moment after the maps changed.
    deadline = time.monotonic() + 5
    while controller.metric("kxlb_drift_repaired_total") < before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert controller.metric("kxlb_drift_repaired_total") >= before + 3


def test_udp_flows_to_a_removed_backend_are_flushed(api, ns, lab, controller):
    svc = make_service(api, ns, "dns", [("dns", 53, "UDP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 3)
    before = controller.metric("kxlb_conntrack_reconciler_deleted_entries_total", ip_family="IPv4") or 0
    with udp_connect(lab.client, ip, 53) as s:
        s.send(b"one")
        first = s.recv(100).split()[0].decode()
        left = [b for i, b in enumerate(backend_ips(lab)) if f"be{i}" != first]
        put_slice(api, ns, "dns", [(b, READY) for b in left], [("dns", BACKEND_PORT, "UDP")])
        wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 2)
        deadline = time.monotonic() + 30   # a guard: the loop ends at the first answer from another backend
        while True:  # the flush follows the map update in the same sync (seconds on a busy machine)
            s.send(b"two")
            second = s.recv(100).split()[0].decode()
            if second != first or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert second != first
    # One entry: the flow's one conntrack record holds both directions (as one
    # nf_conntrack entry does, which kube-proxy's counter of the same name counts).
    assert controller.metric("kxlb_conntrack_reconciler_deleted_entries_total", ip_family="IPv4") >= before + 1


def test_udp_flows_to_draining_endpoints_and_deleted_services_are_kept(api, ns, lab, controller):
    """kube-proxy's cleanup rules: a terminating endpoint that still serves keeps its UDP
    flow (graceful drain), and so does a flow of a Service that is deleted."""
    svc = make_service(api, ns, "drain", [("dns", 53, "UDP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 3)
    with udp_connect(lab.client, ip, 53) as s:
        s.send(b"one")
        first = s.recv(100).split()[0].decode()
        eps = [(b, DRAINING if f"be{i}" == first else READY) for i, b in enumerate(backend_ips(lab))]
        put_slice(api, ns, "drain", eps, [("dns", BACKEND_PORT, "UDP")])
        wait_maps(lab, lambda m: len(m.get(f"{ip}:53/udp", [])) == 2)  # no new flows to it
        time.sleep(1.5)  # a sync or two, each rescanning conntrack
        for _ in range(5):
            s.send(b"again")
            assert s.recv(100).split()[0].decode() == first
        from kubernetes import client
        client.CoreV1Api(api).delete_namespaced_service("drain", ns)
        wait_maps(lab, lambda m: f"{ip}:53/udp" not in m)
        time.sleep(1.5)
        s.send(b"after delete")
        assert s.recv(100).split()[0].decode() == first


def test_host_network_processes_reach_services_through_socket_hooks(api, ns, lab, controller):
    svc = make_service(api, ns, "hostnet", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)])
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:80/tcp", [])) == 3)
    code = ("import socket; c = socket.create_connection(('%s', 80), timeout=3); c.sendall(b'hi\\n'); "
            "print(c.recv(100).decode().split()[0], c.getpeername()[0])" % ip)
    # Into the node's cgroup first (`ip netns exec` hides the host's /sys), then its netns.
    r = subprocess.run(["sh", "-c", f"echo $$ > {controller.cgroup}/cgroup.procs && "
                        f"exec ip netns exec {lab.node} {sys.executable} -c \"{code}\""],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    name, peer = r.stdout.split()
    assert name in {"be0", "be1", "be2"} and peer == ip


def on_node(controller, lab, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python ``code`` as a host-network process of the node: in its cgroup (the socket
    hooks) first, as `ip netns exec` hides the host's /sys, then in its netns."""
    return subprocess.run(["sh", "-c", f"echo $$ > {controller.cgroup}/cgroup.procs && exec ip netns exec {lab.node} "
                           f"{sys.executable} -c \"$0\" \"$@\"", code, *args], capture_output=True, text=True,
                          timeout=30)


def test_session_affinity_holds_for_host_network_processes(api, ns, lab, controller):
    """sessionAffinity ClientIP in the socket hooks: the node is one client, so every new
    connection from its processes goes to the same backend."""
    svc = make_service(api, ns, "sticky", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)],
                       sessionAffinity="ClientIP")
    ip = svc["spec"]["clusterIP"]
    wait_maps(lab, lambda m: len(m.get(f"{ip}:80/tcp", [])) == 3)
    code = ("import socket, sys\n"
            "for _ in range(12):\n"
            "    c = socket.create_connection((sys.argv[1], 80), timeout=3); c.sendall(b'hi\\n')\n"
            "    print(c.recv(100).decode().split()[0]); c.close()\n")
    r = on_node(controller, lab, code, ip)
    names = r.stdout.split()
    assert len(names) == 12 and len(set(names)) == 1 and names[0] in {"be0", "be1", "be2"}, (r.stdout, r.stderr)


def test_host_network_connect_fails_as_kube_proxy_would(api, ns, lab, controller):
    """Socket hooks: no endpoint at all -> ECONNREFUSED at once (kube-proxy rejects);
    internalTrafficPolicy Local with no endpoint on this node -> ETIMEDOUT at once (kube-proxy
    drops: the connect would only have timed out)."""
    empty = make_service(api, ns, "empty", [("http", 80, "TCP")], [])
    local = make_service(api, ns, "itp", [("http", 80, "TCP")], [(ip, READY) for ip in backend_ips(lab)],
                         internalTrafficPolicy="Local")
    for svc in (empty, local):
        wait_maps(lab, lambda m, s=svc: f"{s['spec']['clusterIP']}:80/tcp" in m)
    code = ("import socket, errno, sys\n"
            "for ip in sys.argv[1:]:\n"
            "    try: socket.create_connection((ip, 80), timeout=10); print('connected')\n"
            "    except OSError as e: print(errno.errorcode.get(e.errno, e))\n")
    r = on_node(controller, lab, code, empty["spec"]["clusterIP"], local["spec"]["clusterIP"])
    assert r.stdout.split() == ["ECONNREFUSED", "ETIMEDOUT"], (r.stdout, r.stderr)
    # kube-proxy's gauge: one service port whose Local policy has no local endpoint.
    assert controller.metric("kxlb_sync_proxy_rules_no_local_endpoints_total", traffic_policy="internal") == 1
    assert controller.metric("kxlb_sync_proxy_rules_no_local_endpoints_total", traffic_policy="external") == 0


def test_health_readiness_and_metrics(controller):
    assert http_get("/healthz")[0] == 200 and http_get("/livez")[0] == 200 and http_get("/readyz")[0] == 200
    text = http_get("/metrics")[1]
    for name in ("kxlb_sync_proxy_rules_duration_seconds_bucket", "kxlb_sync_proxy_rules_last_timestamp_seconds",
                 "kxlb_services_programmed", "kxlb_endpoints_programmed", "kxlb_map_capacity",
                 "kxlb_network_programming_duration_seconds_bucket"):
        assert name in text, name
    assert controller.metric("kxlb_sync_proxy_rules_last_timestamp_seconds") > time.time() - 60


def test_a_service_with_more_endpoints_than_4096_is_programmed_whole(api, ns, lab, controller):
    """kube-proxy uses every endpoint: 5,000 on one port (over the 4,096 a set once could
    hold, when the whole port was skipped and its cluster IP dropped everything) are all
    in the maps, in a Maglev table of the default 16381, and other services go on."""
    big = make_service(api, ns, "big", [("http", 80, "TCP")], [])
    for s in range(5):
        put_slice(api, ns, "big", [(f"10.77.{s * 4 + i // 250}.{i % 250 + 1}", READY) for i in range(1000)],
                  [("http", BACKEND_PORT, "TCP")], slice_name=f"big-{s}")
    ok = make_service(api, ns, "small", [("http", 80, "TCP")], [(lab.backend_ip(2), READY)])
    key, small = f"{big['spec']['clusterIP']}:80/tcp", f"{ok['spec']['clusterIP']}:80/tcp"
    # Both: on a busy machine the small Service may be programmed a sync after the big one.
    m = wait_maps(lab, lambda m: len(m.get(key, ())) == 5000 and len(m.get(small, ())) == 1, timeout=30,
                  what="5000 backends of big and small's one")
    assert len(set(m[key])) == 5000
    with Maps.open(lab.pin_dir) as maps:
        v = maps.services.get(ServiceKey(big["spec"]["clusterIP"], 80, socket.IPPROTO_TCP).to_c())
        assert (v.count, v.table_size) == (5000, 16381)
    assert names_over(lab, ok["spec"]["clusterIP"], 80, 3) == {"be2"}
