"""The lab with real nodes (``kxlb lab up --kubelet``): a kubelet, containerd and runc
per node, pods from the e2e framework's agnhost image, and the service proxies deployed
as clusters deploy them: kxlb from deploy/kxlb.yaml, kube-proxy from kubeadm's DaemonSet,
each from the image the lab builds. The Service tests run against both, on the same lab;
so do the upstream Conformance Services specs (lab/e2e.py).

A lab of its own (name ``kxkt``, ports shifted by 3300), beside the session lab of the
other lab tests; it is torn down at the end of the module, and the test of that checks
that nothing of it is left: processes, namespaces, cgroups (v1 and v2), the addresses
it put on the control plane's interface.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from kxlb.lab import e2e, images, kubelet, procs, proxies, proxyimages
from kxlb.lab.cluster import MARKER_ENV, Lab

WORKDIR = Path(tempfile.gettempdir()) / "kxlb-test-kubelet-lab"
NAME = "kxkt"


@pytest.fixture(scope="module")
def klab(lab_bin_dir):
    lab = Lab(WORKDIR, name=NAME, nodes=2, proxy="kxlb", port_offset=3300, kubelet=True,
              log=lambda m: print(f"kubelet lab: {m}", flush=True))
    lab.up(build=False)
    try:
        lab.kubectl("create", "namespace", "kt")
        yield lab
    finally:
        lab.down()


def agnhost_pod(name: str, node: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "kt", "labels": labels or {}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "agnhost", "image": images.AGNHOST_IMAGE,
                                     "args": ["netexec", "--http-port=8080", "--udp-port=8081"],
                                     "ports": [{"containerPort": 8080}, {"containerPort": 8081, "protocol": "UDP"}],
                                     "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080},
                                                        "periodSeconds": 1}}]}}


def apply(lab: Lab, *objs: dict) -> None:
    subprocess.run([str(lab.bin_dir / "kubectl"), f"--kubeconfig={lab.kubeconfig}", "apply", "-f", "-"],
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
                   check=True, capture_output=True, text=True)


def wait_ready(lab: Lab, *pods: str) -> dict:
    lab.kubectl("-n", "kt", "wait", "--for=condition=Ready", "--timeout=90s", *(f"pod/{p}" for p in pods),
                timeout=120)
    return {p: json.loads(lab.kubectl("-n", "kt", "get", "pod", p, "-o", "json").stdout) for p in pods}


def kexec(lab: Lab, pod: str, script: str) -> str:
    return lab.kubectl("-n", "kt", "exec", pod, "--", "sh", "-c", script, timeout=60).stdout


PROXIES = ("kxlb", "kube-proxy")


@pytest.fixture
def proxy(klab, request):
    """The proxy the test asks for (indirect parametrisation), switched on the lab."""
    if klab.proxy != request.param:
        klab.set_proxy(request.param, timeout=180)
    assert klab.proxy == request.param
    return request.param


def test_nodes_run_a_real_kubelet_and_containerd(klab):
    for n in klab.node_specs:
        node = json.loads(klab.kubectl("get", "node", n.name, "-o", "json").stdout)
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.37.1"
        assert info["containerRuntimeVersion"] == "containerd://2.4.2"
        assert node["spec"]["podCIDRs"] == [n.pod_cidr, n.pod_cidr6]
        assert [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"] == [n.ip, n.ip6]
        assert node["metadata"]["labels"]["topology.kubernetes.io/zone"] == n.zone
        # The images were imported, not pulled: both under the e2e framework's names.
        out = klab.kubelet_node(n).ctr("images", "list", "--quiet").stdout.split()
        assert images.PAUSE_IMAGE in out and images.AGNHOST_IMAGE in out


def test_pod_gets_the_lab_network_and_exec_and_logs_work(klab):
    n1 = klab.node(1)
    apply(klab, agnhost_pod("solo", n1.name))
    pod = wait_ready(klab, "solo")["solo"]
    ips = [x["ip"] for x in pod["status"]["podIPs"]]
    assert len(ips) == 2 and ips[1] == n1.pod_ip6(ips[0])
    # The routed veth of the lab's layout: the node reaches the pod through a kxp* link.
    route = subprocess.run(["ip", "-n", n1.netns, "route", "get", ips[0]], capture_output=True, text=True).stdout
    assert " dev kxp" in route, route
    # exec and logs go API server -> relay -> kubelet (TLS, webhook authn/authz).
    assert kexec(klab, "solo", "hostname").strip() == "solo"
    assert kexec(klab, "solo", "cat /etc/resolv.conf").splitlines()[1] == f"nameserver {kubelet.CLUSTER_DNS}"
    assert "Started HTTP server on port 8080" in klab.kubectl("-n", "kt", "logs", "solo").stdout


@pytest.mark.parametrize("proxy", PROXIES, indirect=True)
def test_proxy_runs_as_a_daemonset_pod_with_logs_metrics_and_health(klab, proxy):
    name = proxies.daemonset_name(proxy)
    ds = json.loads(klab.kubectl("-n", "kube-system", "get", "daemonset", name, "-o", "json").stdout)
    assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == len(klab.node_specs)
    pods = json.loads(klab.kubectl("-n", "kube-system", "get", "pods", "-o", "json").stdout)["items"]
    mine = [p for p in pods if p["metadata"]["name"].startswith(f"{name}-")]
    # One host-network pod per node, on the node's own address, Ready by its probe.
    assert sorted(p["spec"]["nodeName"] for p in mine) == sorted(n.name for n in klab.node_specs)
    for p in mine:
        node = klab.node(p["spec"]["nodeName"])
        assert p["spec"]["hostNetwork"] and p["status"]["podIP"] == node.ip
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
        want = proxyimages.KXLB_IMAGE if proxy == "kxlb" else f"{proxyimages.KUBE_PROXY_REPO}:v1.37.1"
        assert p["status"]["containerStatuses"][0]["image"] == want
    # Logs through the API server and the kubelet; metrics on the port the pod declares,
    # from another pod, as a Prometheus would scrape them.
    logs = klab.kubectl("-n", "kube-system", "logs", mine[0]["metadata"]["name"]).stdout
    assert ("full sync" in logs) if proxy == "kxlb" else ("Starting" in logs), logs[-2000:]
    apply(klab, agnhost_pod("scraper", klab.node(1).name))
    wait_ready(klab, "scraper")
    metrics = kexec(klab, "scraper", f"curl -s -m 3 http://{klab.node(2).ip}:{proxies.DS_METRICS_PORT}/metrics")
    assert ("kxlb_" if proxy == "kxlb" else "kubeproxy_sync_proxy_rules") in metrics


@pytest.mark.parametrize("proxy", PROXIES, indirect=True)
def test_services_from_pods_nodes_and_outside(klab, proxy):
    n1, n2 = klab.node(1), klab.node(2)
    apply(klab, agnhost_pod("b1", n1.name, {"app": "b"}), agnhost_pod("b2", n2.name, {"app": "b"}),
          agnhost_pod("client", n2.name),
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b", "namespace": "kt"},
           "spec": {"selector": {"app": "b"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080},
                                                        {"name": "udp", "port": 81, "targetPort": 8081,
                                                         "protocol": "UDP"}]}})
    wait_ready(klab, "b1", "b2", "client")
    vip = json.loads(klab.kubectl("-n", "kt", "get", "svc", "b", "-o", "json").stdout)["spec"]["clusterIP"]
    deadline = time.monotonic() + 30
    while True:  # until the EndpointSlice has both and kxlb programmed them
        seen = set(kexec(klab, "client", f"for i in $(seq 12); do curl -s -m 2 http://{vip}/hostname; echo; done")
                   .split())
        if seen == {"b1", "b2"} or time.monotonic() > deadline:
            break
    assert seen == {"b1", "b2"}
    udp = kexec(klab, "client", f"/agnhost connect --protocol udp --timeout 3s {vip}:81 && echo udp-ok")
    assert "udp-ok" in udp
    # From the outside client (via node 1) and from a node's own network namespace.
    out = subprocess.run(["ip", "netns", "exec", klab.client_ns, "curl", "-s", "-m", "3", f"http://{vip}/hostname"],
                         capture_output=True, text=True).stdout
    assert out in ("b1", "b2")
    out = klab.run_in(f"node/{n2.name}", ["curl", "-s", "-m", "3", f"http://{vip}/hostname"]).stdout
    assert out in ("b1", "b2")
    # The `kubernetes` Service from a pod: to the API server through the node's relay.
    version = json.loads(kexec(klab, "client", "curl -sk -m 3 https://10.96.0.1/version"))
    assert version["gitVersion"] == "v1.37.1"


@pytest.mark.parametrize("proxy", PROXIES, indirect=True)
def test_cluster_dns_resolves_service_names(klab, proxy):
    """CoreDNS (lab/addons/coredns.yaml) behind the kube-dns Service, through the proxy:
    the name a pod's resolv.conf points at answers with the Service's clusterIP."""
    klab.kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=120s", timeout=150)
    apply(klab, agnhost_pod("dnsclient", klab.node(1).name))
    wait_ready(klab, "dnsclient")
    vip = json.loads(klab.kubectl("get", "svc", "kubernetes", "-o", "json").stdout)["spec"]["clusterIP"]
    out = kexec(klab, "dnsclient", "nslookup kubernetes.default.svc.cluster.local")
    assert vip in out.split("Name:", 1)[-1], out
    # The search path of the pod's resolv.conf, and TCP to the resolved name.
    assert json.loads(kexec(klab, "dnsclient", "curl -sk -m 5 https://kubernetes.default/version"))["gitVersion"] \
        == "v1.37.1"



def kxlb_pods_logs(lab: Lab) -> str:
    return lab.kubectl("-n", "kube-system", "logs", "-l", "app.kubernetes.io/name=kxlb", "--tail=-1",
                       "--max-log-requests=10", check=False, timeout=60).stdout


def roll_kxlb(lab: Lab) -> None:
    lab.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/kxlb")
    lab.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kxlb", "--timeout=600s", timeout=620)


@pytest.mark.parametrize("proxy", ["kxlb"], indirect=True)
def test_kxlb_daemonset_rolls_and_resizes_conntrack_under_open_connections(klab, proxy):
    """The DaemonSet restarted (a new pod takes the old one's pins without compiling) and
    given a new conntrack size (conntrack.min in its ConfigMap: the new pods compile and
    migrate the table), one node at a time, with HTTP keep-alive connections open through a
    cluster IP and a NodePort from the outside client: each keeps its backend throughout."""
    import yaml
    from harness import Holder

    n1, n2 = klab.node(1), klab.node(2)
    apply(klab, agnhost_pod("u1", n1.name, {"app": "u"}), agnhost_pod("u2", n2.name, {"app": "u"}),
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "u", "namespace": "kt"},
           "spec": {"type": "NodePort", "selector": {"app": "u"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    wait_ready(klab, "u1", "u2")
    svc = json.loads(klab.kubectl("-n", "kt", "get", "svc", "u", "-o", "json").stdout)
    vip, node_port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["nodePort"]
    deadline = time.monotonic() + 30
    while True:
        seen = {subprocess.run(["ip", "netns", "exec", klab.client_ns, "curl", "-s", "-m", "2",
                                f"http://{vip}/hostname"], capture_output=True, text=True).stdout for _ in range(8)}
        if seen == {"u1", "u2"} or time.monotonic() > deadline:
            break
    assert seen == {"u1", "u2"}
    holder = Holder(klab.client_ns, [("http", vip, 80)] * 4 + [("http", n2.ip, node_port)] * 4)
    try:
        first = holder.first
        assert set(first) == {"u1", "u2"}, first
        roll_kxlb(klab)
        assert holder.ask("probe") == first
        assert "attached without compiling" in kxlb_pods_logs(klab)
        cm = next(line.split("/", 1)[1] for line in klab.kubectl("-n", "kube-system", "get", "configmap", "-o",
                                                                 "name").stdout.split()
                  if line.startswith("configmap/kxlb"))
        data = json.loads(klab.kubectl("-n", "kube-system", "get", "configmap", cm, "-o", "json").stdout)["data"]
        conf = yaml.safe_load(data["config.conf"])
        conf["conntrack"] = {**(conf.get("conntrack") or {}), "maxPerCore": 0, "min": 200000}
        klab.kubectl("-n", "kube-system", "patch", "configmap", cm, "--type", "merge", "-p",
                     json.dumps({"data": {"config.conf": yaml.safe_dump(conf, sort_keys=False)}}))
        roll_kxlb(klab)
        assert holder.ask("probe") == first
        logs = kxlb_pods_logs(klab)
        # One record per client socket: conntrack.min 200000 is 200000 records, from the
        # default 131072 (kube-proxy's conntrack.min; maxPerCore 32768 x 2 CPUs is less).
        assert "migrated conntrack: capacity 131072 -> 200000" in logs, logs[-3000:]
    finally:
        holder.close()

@pytest.mark.timeout(1800)   # the first run builds e2e.test (3.5 min with a warm Go cache)
@pytest.mark.parametrize("proxy", ("kube-proxy", "kxlb"), indirect=True)
def test_upstream_conformance_services_specs_pass(klab, proxy, tmp_path):
    """The upstream e2e binary's [Conformance] Services specs (lab/e2e.py), first with
    kube-proxy (the reference), then with kxlb: every one passes, none is skipped."""
    results = e2e.run_suite(klab, e2e.e2e_binary(), e2e.SUITES["conformance"], tmp_path / proxy)
    assert len(results) == 15, sorted(results)
    bad = {n: r for n, r in results.items() if r["state"] != "passed"}
    assert not bad, f"{proxy}: {json.dumps(bad, indent=1)}\nlog {tmp_path / proxy / 'e2e.log'}"


@pytest.mark.lab_lifecycle
def test_down_leaves_nothing(klab):
    iface = klab.api_iface
    klab.down()
    # Daemons, relay and containerd's shims (they inherit the marker); the containers
    # went with the cgroups (a cgroup directory is only removed once it is empty).
    assert procs.marked_pids(MARKER_ENV, str(WORKDIR)) == []
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith(f"{NAME}-")]
    for mnt in kubelet.v1_hierarchies().values():
        assert not (mnt / NAME).exists(), f"{mnt / NAME} is left"
    assert not Path(klab.topology.cgroup_dir).exists()
    assert not Path(f"/sys/class/net/{iface}").exists()
    assert not (WORKDIR / "nodes").exists()
