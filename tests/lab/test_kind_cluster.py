"""kxlb on a real kind cluster (lab/kind.py, `make kind`): kind v0.33.0 on the kind lab's own
dockerd, a control plane and two workers with kube-proxy off, kxlb's DaemonSet from
deploy/kxlb.yaml applied unchanged. Checked: the DaemonSet is Ready on every node (its init
container mounted bpffs on nodes that have none; the socket hooks found the cgroup v2
hierarchy of this v1 hybrid host) and stays Ready; ClusterIP, NodePort (local and remote
backends, through kind's strict rp_filter) and cluster DNS answer from pods and from the
nodes; the upstream Conformance Services specs pass; and `down` leaves the host as it was
(no process, mount, bridge, firewall rule or forwarding change).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kxlb.lab import e2e, images, procs
from kxlb.lab.kind import MARKER_ENV, RUN_DIR, STATE_DIR, KindCluster, leftover_mounts

NS = "kxkind"
BACKEND_NODE, OTHER_NODE, CONTROL_PLANE = "kind-worker", "kind-worker2", "kind-control-plane"
pytestmark = pytest.mark.timeout(1800)


def host_state() -> dict:
    """What the kind lab must leave as it found it on the host."""
    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout
    return {"ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text(),
            "ipv6_forwarding": Path("/proc/sys/net/ipv6/conf/all/forwarding").read_text(),
            "iptables": out("iptables-save"), "ip6tables": out("ip6tables-save"),
            "nft": out("nft", "list", "ruleset"),
            "links": sorted(line.split(":")[1].strip().split("@")[0] for line in out("ip", "-o", "link").splitlines()),
            # host-wide, and set by the nodes' kubelets (privileged containers)
            "sysctls": {k: Path("/proc/sys", k).read_text() for k in KindCluster.HOST_SYSCTLS}}


def normalise_rules(state: dict) -> dict:
    """iptables-save's comment lines carry the time of the dump."""
    return {k: "\n".join(l for l in v.splitlines() if not l.startswith("#")) if isinstance(v, str) else v
            for k, v in state.items()}


@pytest.fixture(scope="module")
def cluster(lab_bin_dir):
    c = KindCluster(log=lambda m: print(m, flush=True))
    c.down()   # a crashed run's cluster and dockerd
    before = host_state()
    c.before = before
    times = c.up()
    print(f"kind up: {times}", flush=True)
    c.kubectl("create", "namespace", NS)
    try:
        yield c
    finally:
        c.down()


def kubectl_json(c: KindCluster, *args: str) -> dict:
    return json.loads(c.kubectl(*args, "-o", "json").stdout)


def apply(c: KindCluster, *objs: dict) -> None:
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def pod(name: str, node: str, *, args: list[str], labels: dict | None = None, host_network: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
            "spec": {"nodeName": node, "hostNetwork": host_network, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "agnhost", "image": images.AGNHOST_IMAGE, "args": args}]}}


def in_pod(c: KindCluster, name: str, *cmd: str) -> str:
    return c.kubectl("-n", NS, "exec", name, "--", *cmd, timeout=60).stdout.strip()


def on_node(c: KindCluster, node: str, *cmd: str) -> str:
    return c.docker("exec", node, *cmd, timeout=60).stdout.strip()


@pytest.fixture(scope="module")
def service(cluster):
    """A backend on kind-worker behind a NodePort Service (TCP 80 and UDP 81), and client
    pods: one on the other worker, one with the host network of the control plane."""
    c = cluster
    backend = pod("backend", BACKEND_NODE, args=["netexec", "--http-port=8080", "--udp-port=8081"],
                  labels={"app": "kind-echo"})
    backend["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": 8080},
                                                          "periodSeconds": 1}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": NS},
           "spec": {"type": "NodePort", "selector": {"app": "kind-echo"},
                    "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                              {"name": "udp", "port": 81, "targetPort": 8081, "protocol": "UDP"}]}}
    client = pod("client", OTHER_NODE, args=["pause"])
    hostclient = pod("hostclient", CONTROL_PLANE, args=["pause"], host_network=True)
    hostclient["spec"]["tolerations"] = [{"operator": "Exists"}]
    apply(c, backend, svc, client, hostclient)
    c.kubectl("-n", NS, "wait", "--for=condition=Ready", "--timeout=180s", "pod/backend", "pod/client",
              "pod/hostclient", timeout=200)
    s = kubectl_json(c, "-n", NS, "get", "service", "echo")
    nodes = {n: ip for n, (ip, _) in c.node_facts().items()}
    return {"cluster_ip": s["spec"]["clusterIP"], "node_port": s["spec"]["ports"][0]["nodePort"], "nodes": nodes}


def until(fn, timeout: float = 30):
    """fn() until it returns without an error and truthy; its last value."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:   # the Service may not be programmed yet
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not answered in {timeout:.0f}s: {last}")
        time.sleep(1)


def test_daemonset_is_ready_on_every_node(cluster):
    ds = kubectl_json(cluster, "-n", "kube-system", "get", "daemonset", "kxlb")["status"]
    assert ds["desiredNumberScheduled"] == 3 and ds["numberReady"] == 3, ds
    for node in (CONTROL_PLANE, BACKEND_NODE, OTHER_NODE):
        # kind's nodes boot without bpffs: the init container mounted one on the node itself,
        # and the pins are there (they outlive the pod).
        assert on_node(cluster, node, "findmnt", "-n", "-o", "FSTYPE", "/sys/fs/bpf") == "bpf"
        assert len(on_node(cluster, node, "ls", "/sys/fs/bpf/kxlb").split()) > 10, node
    logs = cluster.kubectl("-n", "kube-system", "logs", "ds/kxlb", "-c", "kxlb").stdout
    hybrid = subprocess.run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"], capture_output=True,
                            text=True).stdout.strip() != "cgroup2fs"
    want = ("socket hooks go on its v2 hierarchy, /sys/fs/cgroup/unified" if hybrid
            else "socket-level load balancing attached to cgroup /sys/fs/cgroup")
    assert want in logs, logs[-2000:]


def test_cluster_ip_and_dns_from_pods_and_nodes(cluster, service):
    vip = service["cluster_ip"]
    name = f"echo.{NS}.svc.cluster.local"
    # From a pod on another node than the backend, by address and by name (CoreDNS, itself
    # behind the kube-dns Service kxlb serves).
    assert until(lambda: in_pod(cluster, "client", "curl", "-s", "-m", "3", f"http://{vip}/hostname")) == "backend"
    assert until(lambda: in_pod(cluster, "client", "curl", "-s", "-m", "3", f"http://{name}/hostname")) == "backend"
    assert until(lambda: in_pod(cluster, "client", "sh", "-c", f"echo hostname | nc -u -w 2 {vip} 81")) == "backend"
    # From the nodes: a process of the node itself, and a host-network pod (its resolver
    # query to the kube-dns Service goes through the socket hooks too).
    assert until(lambda: on_node(cluster, OTHER_NODE, "curl", "-s", "-m", "3", f"http://{vip}/hostname")) == "backend"
    dns = until(lambda: in_pod(cluster, "hostclient", "dig", "+short", "+time=2", "@10.96.0.10", name))
    assert dns == vip
    assert until(lambda: in_pod(cluster, "hostclient", "curl", "-s", "-m", "3", f"http://{vip}/hostname")) == "backend"
    assert until(lambda: on_node(cluster, OTHER_NODE, "curl", "-s", "-m", "3", "-k",
                                 "https://10.96.0.1/version")).find('"gitVersion"') >= 0


def test_node_port_local_and_remote_backend_through_strict_rp_filter(cluster, service):
    """kind sets rp_filter=1 (strict) on its nodes: a NodePort whose backend is on the node
    that received the request (local) used to fail there; remote ones work either way."""
    port = service["node_port"]
    for node in (BACKEND_NODE, OTHER_NODE):
        assert on_node(cluster, node, "sysctl", "-n", "net.ipv4.conf.all.rp_filter") == "1"
    local = service["nodes"][BACKEND_NODE]    # the backend's own node
    remote = service["nodes"][OTHER_NODE]     # the backend is elsewhere
    for target in (local, remote):
        for _ in range(5):   # new connections each time, each a new flow
            got = until(lambda: on_node(cluster, CONTROL_PLANE, "curl", "-s", "-m", "3", f"http://{target}:{port}/hostname"))
            assert got == "backend", (target, got)
        assert until(lambda: in_pod(cluster, "client", "curl", "-s", "-m", "3",
                                    f"http://{target}:{port}/hostname")) == "backend"


@pytest.mark.timeout(2400)
def test_upstream_conformance_services_specs_pass(cluster, tmp_path):
    results = e2e.run_suite(cluster, e2e.e2e_binary(), e2e.SUITES["conformance"], tmp_path)
    assert len(results) == 15, sorted(results)
    bad = {n: r for n, r in results.items() if r["state"] != "passed"}
    assert not bad, f"{json.dumps(bad, indent=1)}\nlog {tmp_path / 'e2e.log'}"


def test_daemonset_stayed_ready(cluster):
    """After everything above, no kxlb pod was restarted (liveness) or became unready."""
    pods = kubectl_json(cluster, "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=kxlb")["items"]
    assert len(pods) == 3
    for p in pods:
        (st,) = p["status"]["containerStatuses"]
        assert st["ready"] and st["restartCount"] == 0, (p["metadata"]["name"], st)


def test_down_leaves_the_host_as_it_was(cluster):
    cluster.down()
    assert procs.marked_pids(MARKER_ENV, str(RUN_DIR)) == []
    assert leftover_mounts() == []
    after = host_state()
    assert normalise_rules(after) == normalise_rules(cluster.before)
    assert STATE_DIR.is_dir()   # the data root stays: the next `up` is warm
