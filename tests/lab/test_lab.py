"""The Kubernetes lab: real control plane, lab nodes, pod agents, kube-proxy as reference."""
from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import echo_service_and_client
from kxlb.lab import kube
from kxlb.lab.client import tcp_request, udp_request
from kxlb.lab.client import http_get
from kxlb.lab.cluster import Lab, LabError, netns_exists
from kxlb.lab.controlplane import APISERVER

pytestmark = pytest.mark.timeout(240)


def _pod_ns(lab, k8s, pod: dict) -> str:
    return lab.resolve_target(f"{k8s.name}/{pod['metadata']['name']}")[0]


def _by_node(pods: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in pods:
        out.setdefault(p["spec"]["nodeName"], []).append(p)
    return out


def test_deployment_pods_ready_and_endpointslices(lab, k8s):
    k8s.deployment("web", 3)
    k8s.service("web")
    pods = k8s.ready_pods("web", 3)
    nodes = {n.name: n for n in lab.node_specs}
    assert set(_by_node(pods)) == set(nodes), "the spread constraint puts pods on both nodes"
    for p in pods:
        st, node = p["status"], nodes[p["spec"]["nodeName"]]
        assert ipaddress.ip_address(st["podIP"]) in ipaddress.ip_network(node.pod_cidr)
        assert st["podIP"] != node.gateway
        # dual-stack: the IPv6 twin with the same host number, in the node's IPv6 podCIDR
        assert st["podIPs"] == [{"ip": st["podIP"]}, {"ip": node.pod_ip6(st["podIP"])}]
        assert ipaddress.ip_address(st["podIPs"][1]["ip"]) in ipaddress.ip_network(node.pod_cidr6)
        assert st["hostIP"] == node.ip and st["phase"] == "Running"
        assert st["hostIPs"] == [{"ip": node.ip}, {"ip": node.ip6}]
        conds = {c["type"]: c["status"] for c in st["conditions"]}
        assert conds["Ready"] == conds["ContainersReady"] == conds["Initialized"] == conds["PodScheduled"] == "True"
        (cs,) = st["containerStatuses"]
        assert cs["ready"] and cs["started"] and "running" in cs["state"] and cs["restartCount"] == 0
        # The pod's network: its own namespace, a kxp* veth on the node side.
        ns = _pod_ns(lab, k8s, p)
        assert netns_exists(ns)
        veth = "kxp" + p["metadata"]["uid"].replace("-", "")[:8]
        assert subprocess.run(["ip", "-n", node.netns, "link", "show", veth], capture_output=True).returncode == 0

    # The real EndpointSlice controller publishes them, with node names and the named ports.
    ips = [p["status"]["podIP"] for p in pods]
    eps = k8s.wait_endpoints("web", ips)
    assert {e["ip"]: e["node"] for e in eps} == {p["status"]["podIP"]: p["spec"]["nodeName"] for p in pods}
    assert eps[0]["ports"] == {"tcp": 8080, "udp": 8080, "http": 80}

    # Readiness through the agent: not ready -> not ready (and not serving) in the slice.
    victim, vip_ = pods[0], pods[0]["status"]["podIP"]
    k8s.set_ready(victim["metadata"]["name"], False)
    eps = k8s.wait_endpoints("web", [i for i in ips if i != vip_])
    e = next(e for e in eps if e["ip"] == vip_)
    assert not e["ready"] and not e["serving"] and not e["terminating"]
    k8s.set_ready(victim["metadata"]["name"], True)
    k8s.wait_endpoints("web", ips)

    # Termination: the agent keeps the pod Ready and serving during its grace period, so
    # the slice shows it serving + terminating (KEP-1669); then the pod, its namespace and
    # its veth go, and the address is free again.
    k8s.scale("web", 2)
    gone = kube.wait_for(lambda: [p for p in k8s.pods("app=web") if p["metadata"].get("deletionTimestamp")],
                         30, "a terminating pod")[0]
    gip, gns = gone["status"]["podIP"], _pod_ns(lab, k8s, gone)
    e = next(e for e in k8s.endpoints("web") if e["ip"] == gip)
    assert (e["ready"], e["serving"], e["terminating"]) == (False, True, True), e
    assert tcp_request(gns, gip, 8080, "still here")[0] == f"{gone['metadata']['name']} still here"
    kube.wait_for(lambda: len(k8s.pods("app=web")) == 2, 30, "the terminating pod deleted by the agent")
    assert not netns_exists(gns)
    kube.wait_for(lambda: gip not in {e["ip"] for e in k8s.endpoints("web")}, 30, "endpoint removed")


def test_pods_reach_each_other_across_nodes(lab, k8s):
    k8s.deployment("echo", 2)
    pods = k8s.ready_pods("echo", 2)
    a, b = pods
    assert a["spec"]["nodeName"] != b["spec"]["nodeName"]
    for src, dst in ((a, b), (b, a)):
        ns, ip, name = _pod_ns(lab, k8s, src), dst["status"]["podIP"], dst["metadata"]["name"]
        reply, peer = tcp_request(ns, ip, 8080, "ping")
        assert reply == f"{name} ping" and peer == (ip, 8080)
        assert udp_request(ns, ip, 8080, "dgram")[0] == f"{name} dgram"
        assert http_get(ip, 80, "/", ns=ns) == (200, name)
    # Host network of a node to a pod on the other node; a node to its own pod.
    n1 = lab.node(1)
    for p in pods:
        assert tcp_request(n1.netns, p["status"]["podIP"], 8080, "host")[0] == f"{p['metadata']['name']} host"
    # A pod's default route covers the service CIDR; the client sees no pod network.
    route = subprocess.run(["ip", "-n", _pod_ns(lab, k8s, a), "route", "get", "10.96.0.10"],
                           capture_output=True, text=True).stdout
    assert f"via {lab.node(a['spec']['nodeName']).gateway} dev eth0" in route
    assert subprocess.run(["ip", "-n", lab.client_ns, "route", "get", a["status"]["podIP"]],
                          capture_output=True).returncode != 0


def test_kubectl_status_and_exec(lab):
    out = lab.kubectl("get", "nodes", "-o", "json").stdout
    nodes = {n["metadata"]["name"]: n for n in json.loads(out)["items"]}
    assert set(nodes) == {n.name for n in lab.node_specs}
    for spec in lab.node_specs:
        n = nodes[spec.name]
        assert n["spec"]["podCIDR"] == spec.pod_cidr and not n["spec"].get("taints")
        assert n["spec"]["podCIDRs"] == [spec.pod_cidr, spec.pod_cidr6]
        assert [a for a in n["status"]["addresses"] if a["type"] == "InternalIP"] == \
            [{"type": "InternalIP", "address": spec.ip}, {"type": "InternalIP", "address": spec.ip6}]
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        assert int(n["status"]["allocatable"]["pods"]) > 0
    # The node Lease is renewed.
    lease = json.loads(lab.kubectl("get", "lease", "-n", "kube-node-lease", lab.node(1).name, "-o", "json").stdout)
    assert lease["spec"]["holderIdentity"] == lab.node(1).name

    kxlb = [sys.executable, "-m", "kxlb", "lab"]
    wd = ["--workdir", str(lab.workdir)]
    st = json.loads(subprocess.run(kxlb + ["status", "--json"] + wd, capture_output=True, text=True,
                                   check=True).stdout)
    assert st["up"] and st["kubeconfig"] == str(lab.kubeconfig)
    assert [(n["name"], n["netns"], n["internal_ip"], n["pod_cidr"]) for n in st["nodes"]] == \
        [(n.name, n.netns, n.ip, n.pod_cidr) for n in lab.node_specs]
    assert st["client"] == {"netns": lab.client_ns, "ip": lab.client_ip, "present": True,
                            "routes": [f"{r} via {lab.node(1).ip}" for r in
                                       ("10.96.0.0/16", "10.250.100.0/24", "10.250.200.0/24")]
                            + [f"fd00:10:96::/112 via {lab.node(1).ip6}"]}

    # exec node/NAME: the node's namespace and its cgroup; kubectl works there (API relay).
    n2 = lab.node(2)
    script = "import os; print(open('/proc/self/cgroup').read().strip()); print(os.listdir('/sys/class/net'))"
    r = subprocess.run(kxlb + ["exec"] + wd + [f"node/{n2.name}", "--", sys.executable, "-c", script],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cg = "/" + os.path.relpath(n2.cgroup, lab.topology.cgroup_root)
    assert f"0::{cg}" in r.stdout.splitlines(), r.stdout
    assert "eth0" in r.stdout
    r = subprocess.run(kxlb + ["exec"] + wd + ["node/2", "--", "kubectl", "get", "nodes", "-o", "name"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and f"node/{n2.name}" in r.stdout, r.stderr
    r = subprocess.run(kxlb + ["exec"] + wd + ["client", "--", "ip", "-o", "-4", "addr", "show", "eth0"],
                       capture_output=True, text=True)
    assert f"{lab.client_ip}/24" in r.stdout, r.stderr
    r = subprocess.run(kxlb + ["exec"] + wd + ["node/nope", "--", "true"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("kxlb: error: no node 'nope'"), r.stderr


def test_another_workdir_never_touches_a_running_lab(lab, tmp_path):
    other = Lab(tmp_path / "other", name=lab.name, port_offset=lab.port_offset + 500, log=print)
    other.down()  # no lab there: must not remove the namespaces, cgroups, pins of ours
    with pytest.raises(LabError, match=f"a lab named {lab.name} runs from {lab.workdir}"):
        other.up(build=False)
    assert lab.topology.problems() == []
    assert lab.status()["up"]


def test_agent_restart_adopts_running_pods(lab, k8s):
    k8s.deployment("keep", 2)
    before = {p["metadata"]["name"]: p for p in k8s.ready_pods("keep", 2)}
    ns_of = {name: _pod_ns(lab, k8s, p) for name, p in before.items()}
    for n in lab.node_specs:
        lab.restart_agent(n.name)
    k8s.deployment("new", 2)  # the restarted agents serve new pods too
    k8s.ready_pods("new", 2)
    after = {p["metadata"]["name"]: p for p in k8s.ready_pods("keep", 2)}
    assert set(after) == set(before)
    for name, p in after.items():
        assert p["status"]["podIP"] == before[name]["status"]["podIP"]
        assert p["status"]["containerStatuses"][0]["restartCount"] == 0
        assert tcp_request(ns_of[name], p["status"]["podIP"], 8080)[0] == f"{name} hello"


def test_apiserver_kill_and_restart(lab, k8s):
    k8s.deployment("survivor", 2)
    k8s.service("survivor")
    pods = k8s.ready_pods("survivor", 2)
    cp = lab.controlplane
    assert cp.kill(APISERVER) is not None
    time.sleep(2)
    # Workloads keep serving without the API server.
    p = pods[0]
    assert tcp_request(_pod_ns(lab, k8s, p), p["status"]["podIP"], 8080)[0].startswith(p["metadata"]["name"])
    cp.restart(APISERVER)
    # Controllers, scheduler, agents and EndpointSlices pick up again.
    k8s.scale("survivor", 4)
    pods = k8s.ready_pods("survivor", 4, timeout=90)
    k8s.wait_endpoints("survivor", [p["status"]["podIP"] for p in pods], timeout=90)
    assert lab.status()["up"]
    assert lab.kubectl("get", "pods", "-n", k8s.name, "-o", "name").stdout.count("pod/") == 4


def test_kube_proxy_clusterip_reference(kube_proxy, k8s):
    """Real kube-proxy (nftables) runs in the lab nodes and serves a ClusterIP; every
    traffic check is in test_differential.py, run against kube-proxy and kxlb alike."""
    lab = kube_proxy
    assert lab.proxy == "kube-proxy"
    vip, names, _, cns = echo_service_and_client(lab, k8s)

    def answered() -> bool:
        try:
            return tcp_request(cns, vip, 80)[0].split()[0] in names
        except OSError:
            return False
    kube.wait_for(answered, 30, "kube-proxy serves the ClusterIP", interval=0.05)
    # kube-proxy's tables are in the nodes' namespaces; set_proxy("none") removes them.
    assert "table ip kube-proxy" in subprocess.run(["ip", "netns", "exec", lab.node(1).netns, "nft", "list", "tables"],
                                                   capture_output=True, text=True).stdout
    lab.set_proxy("none")
    assert "kube-proxy" not in subprocess.run(["ip", "netns", "exec", lab.node(1).netns, "nft", "list", "tables"],
                                              capture_output=True, text=True).stdout
    with pytest.raises(OSError):
        tcp_request(cns, vip, 80)


def _node_state(lab, mode: str) -> str:
    """What a proxy mode leaves in node 1: iptables' KUBE- chains, or the XDP programs."""
    ns = lab.node(1).netns
    if mode.startswith("kube-proxy-iptables"):
        save = "iptables-legacy-save" if mode.endswith("-legacy") else "iptables-nft-save"
        return subprocess.run(["ip", "netns", "exec", ns, save, "-t", "nat"], capture_output=True, text=True).stdout
    return subprocess.run(["ip", "-n", ns, "link", "show", "eth0"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("mode,mark", [("kube-proxy-iptables", "KUBE-SERVICES"),
                                       ("kube-proxy-iptables-legacy", "KUBE-SERVICES"), ("kxlb-xdp", "xdp")])
def test_other_proxy_modes_serve_and_leave_nothing(with_proxy, k8s, mode, mark):
    """The lab's other modes (bench-e2e runs them beside kube-proxy nftables and kxlb
    tc): kube-proxy in iptables mode on either backend (its rules land in the backend
    asked for: the mark is looked for with that backend's save) and kxlb at XDP serve a
    ClusterIP from a pod and from outside; switching back to none removes their state
    from the nodes."""
    lab = with_proxy(mode)
    vip, names, _, cns = echo_service_and_client(lab, k8s)
    for origin in (cns, lab.client_ns):
        def answered() -> bool:
            try:
                return tcp_request(origin, vip, 80)[0].split()[0] in names
            except OSError:
                return False
        kube.wait_for(answered, 30, f"{mode} serves the ClusterIP from {origin}", interval=0.05)
    assert mark in _node_state(lab, mode)
    if mode.endswith("-legacy"):
        assert mark not in _node_state(lab, "kube-proxy-iptables"), "legacy mode wrote to the nf_tables backend"
    lab.set_proxy("none")
    assert mark not in _node_state(lab, mode)
    with pytest.raises(OSError):
        tcp_request(cns, vip, 80)


def test_the_readme_demo_runs_on_the_lab(lab, capsys):
    """`make demo` (README's first command) against the session lab with kxlb: every
    request answered, and the LoadBalancer part shows eTP Local keeping the client's
    address while eTP Cluster masquerades it."""
    from kxlb.lab import demo

    lab.set_proxy("kxlb")
    try:
        demo.run(workdir=lab.workdir, requests=4, build=False)
    finally:
        lab.set_proxy("none")
    out = capsys.readouterr().out
    assert "no answer" not in out and "unanswered 0" in out, out
    cluster, local = out.split("externalTrafficPolicy Cluster")[1].split("externalTrafficPolicy Local")
    assert f"saw {lab.client_ip}" not in cluster and f"saw {lab.client_ip}" in local, out
