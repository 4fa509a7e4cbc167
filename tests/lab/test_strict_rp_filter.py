"""Nodes with strict reverse-path filtering (`kxlb lab up --rp-filter strict`:
net.ipv4.conf.{all,default,<every interface>}.rp_filter=1 on every node, as the CIS
benchmarks and kind set it), through the real kube-proxy and through kxlb.

kube-proxy never meets the filter: netfilter's DNAT changes only destinations before
routing and un-NATs replies after it. kxlb translates at tc ingress, before routing, so
the filter judges translated sources (a reply from a service address, a masqueraded
packet from the node's): the loader makes each device it hooks loose and leaves
conf.all strict (docs/datapath.md, "Reverse-path filtering"). The same Service traffic
must pass both: a cluster IP from a pod, a NodePort from the outside client masqueraded
to a pod on the other node, the cluster IP from outside, a hostNetwork backend, and the
node's own processes.

A lab of its own (name ``kxrp``, ports shifted by 3700), torn down at the end of the module.
"""
from __future__ import annotations

import sys
from collections import Counter

import pytest

from conftest import lab_of_its_own, namespace_in
from kxlb.lab import kube
from kxlb.lab.client import tcp_request, udp_request
from kxlb.lab.nodes import node_conf

STRICT, LOOSE = 1, 2
# The hostNetwork echo pod's port (the node's own): one per proxy, as the previous test's
# namespace may still be going away.
HOST_PORT = {"kube-proxy": 18180, "kxlb": 18190}


@pytest.fixture(scope="module")
def strict_lab(lab_bin_dir):
    with lab_of_its_own("kxrp", 3700, rp_filter=STRICT) as lab:
        yield lab


@pytest.fixture
def k8s(strict_lab, request):
    with namespace_in(strict_lab, request) as ns:
        yield ns


def answers(ns: str, addr: str, port: int, proto: str = "TCP", tries: int = 20) -> Counter:
    """Counter of (pod, client address it saw) over *tries* new connections (TCP) or
    fresh sockets (UDP); failures count as ("error", name)."""
    seen: Counter = Counter()
    for _ in range(tries):
        try:
            request = tcp_request if proto == "TCP" else udp_request
            reply = request(ns, addr, port, "clientip", timeout=2)[0].split()
            seen[(reply[0], reply[1].rsplit(":", 1)[0])] += 1
        except OSError as exc:
            seen[("error", type(exc).__name__)] += 1
    return seen


def settle_then_check(what: str, probe, want: set) -> None:
    """Wait until *probe()* (a Counter of (pod, source)) shows exactly the pairs of *want*
    (the proxies program asynchronously); then one more round must show them with no
    failure."""
    last: list = [None]

    def ok():
        last[0] = probe()
        return set(last[0]) == want
    try:
        kube.wait_for(ok, 60, what, interval=0.3)
    except Exception:
        pytest.fail(f"{what}: want {sorted(want)}, last round {dict(last[0])}")
    seen = probe()
    assert set(seen) == want, f"{what}: {dict(seen)}"


NODE_CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
s.sendall(b"clientip\\n")
print(s.makefile().readline().split()[0])
"""


@pytest.mark.parametrize("proxy", ["kube-proxy", "kxlb"])
def test_service_traffic_through_strict_nodes(strict_lab, k8s, proxy):
    lab = strict_lab
    lab.set_proxy(proxy)
    node1, node2 = lab.node(1), lab.node(2)
    port = HOST_PORT[proxy]
    k8s.pod("local", labels={"app": "web"}, node_name=node1.name)
    k8s.pod("remote", labels={"app": "web"}, node_name=node2.name)
    k8s.pod("host2", labels={"app": "hostnet"}, node_name=node2.name, host_network=True,
            ports=[{"name": "tcp", "containerPort": port, "protocol": "TCP"}])
    k8s.pod("client", labels={"app": "client"}, ports=[], node_name=node2.name)
    pods = k8s.ready_pods("app=web", 2)
    k8s.ready_pods("app=hostnet", 1)
    pods += k8s.ready_pods("app=client", 1)
    ip = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    web = k8s.service("web", selector={"app": "web"}, type="NodePort",
                      ports=[{"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"},
                             {"name": "udp", "port": 80, "targetPort": "udp", "protocol": "UDP"}])
    host = k8s.service("hostnet", selector={"app": "hostnet"}, type="NodePort",
                       ports=[{"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"}])
    k8s.wait_endpoints("web", [ip["local"], ip["remote"]])
    k8s.wait_endpoints("hostnet", [node2.ip])
    vip, hvip = web["spec"]["clusterIP"], host["spec"]["clusterIP"]
    np, hnp = web["spec"]["ports"][0]["nodePort"], host["spec"]["ports"][0]["nodePort"]
    cns = lab.resolve_target(f"{k8s.name}/client")[0]
    lns = lab.resolve_target(f"{k8s.name}/local")[0]

    # From a pod on node 2: its own node's pod and, through eth0, node 1's; source kept.
    for proto in ("TCP", "UDP"):
        settle_then_check(f"{proxy}: cluster IP from a pod ({proto})",
                          lambda proto=proto: answers(cns, vip, 80, proto),
                          {("local", ip["client"]), ("remote", ip["client"])})
    # From outside, through node 1's NodePort and through the cluster IP (routed via
    # node 1): node 2's pod sees node 1's address (masqueraded); node 1's pod does not
    # see the client's either (kube-proxy masquerades to the pod gateway's address,
    # kxlb to the node's).
    for what, addr, dport in (("node 1's NodePort", node1.ip, np), ("the cluster IP", vip, 80)):
        def outside(addr=addr, dport=dport):
            return Counter({(pod, "other" if pod == "local" else src): n
                            for (pod, src), n in answers(lab.client_ns, addr, dport).items()})
        settle_then_check(f"{proxy}: {what} from outside", outside, {("local", "other"), ("remote", node1.ip)})
    # A hostNetwork backend on node 2: from outside through node 1 (masqueraded), and
    # from a pod on node 1 through the cluster IP (source kept).
    settle_then_check(f"{proxy}: a hostNetwork backend through node 1's NodePort",
                      lambda: answers(lab.client_ns, node1.ip, hnp), {("host2", node1.ip)})
    settle_then_check(f"{proxy}: a hostNetwork backend through the cluster IP from a pod on node 1",
                      lambda: answers(lns, hvip, 80), {("host2", ip["local"])})
    # The node's own processes (host network) to the cluster IP.
    r = lab.run_in(f"node/{node1.name}", [sys.executable, "-c", NODE_CLIENT, vip, "80"], timeout=30)
    assert r.returncode == 0 and r.stdout.strip() in ("local", "remote"), r.stderr

    # It all ran with strict filtering: conf.all and conf.default stay strict on every
    # node; kube-proxy leaves every interface strict, kxlb made the ones it hooks (eth0,
    # the pods' kxp*) loose and no other.
    for n in (node1, node2):
        conf = node_conf(n.netns, "rp_filter")
        assert conf["all"] == conf["default"] == conf["lo"] == STRICT, (n.name, conf)
        hooked = {k: v for k, v in conf.items() if k == "eth0" or k.startswith("kxp")}
        assert len(hooked) >= 2, (n.name, conf)
        want = STRICT if proxy == "kube-proxy" else LOOSE
        assert set(hooked.values()) == {want}, (n.name, conf)
