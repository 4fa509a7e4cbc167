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

The same lab (so CI builds one lab for all of it) has a small NodePort range and kxlb's
masquerade ports right below it, for two more of issue 26's checks, each with both proxies:
every NodePort of the range allocated, then 500 connections from the outside client
masqueraded through node 1 to a pod on node 2; and a spoofed SYN flood at that kind of
frontend, then legitimate connections. Both must all succeed.

A lab of its own (name ``kxrp``, ports shifted by 3700), torn down at the end of the module.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import struct
import subprocess
import sys
import time
from collections import Counter

import pytest

from conftest import lab_of_its_own, namespace_in
from kxlb.lab import kube
from kxlb.lab.client import tcp_connect, tcp_exchange, tcp_request, udp_request
from kxlb.lab.nodes import FABRIC_CIDR, node_conf

STRICT, LOOSE = 1, 2
# A small NodePort range (the API server's and the controller's), so that a test can
# allocate every NodePort of it cheaply, and kxlb's masquerade range right below it: the
# two must never overlap (issue 26, defect 1: a backend's SYN-ACK to a masquerade port that
# was also a live NodePort became a new flow to that NodePort's backend). 10,000 ports:
# many more than a backend's SYN queue (1024 for the echo server), as the default range's
# 28,976 are (docs/datapath.md, "Under a flood").
NODE_PORTS = (30000, 30099)
MASQ_PORTS = (20000, 29999)
# The hostNetwork echo pod's port (the node's own): one per proxy, as the previous test's
# namespace may still be going away.
HOST_PORT = {"kube-proxy": 18180, "kxlb": 18190}


@pytest.fixture(scope="module")
def strict_lab(lab_bin_dir):
    with lab_of_its_own("kxrp", 3700, rp_filter=STRICT, node_port_range="%d-%d" % NODE_PORTS,
                        masquerade_ports="%d-%d" % MASQ_PORTS) as lab:
        yield lab


@pytest.fixture(scope="module", params=["kube-proxy", "kxlb"])
def proxy(strict_lab, request):
    """The proxy on every node, for every test of the module in turn (module-scoped, so
    pytest runs all of one proxy's tests before switching: kxlb starts once)."""
    if strict_lab.set_proxy(request.param) != request.param:
        pytest.fail(f"proxy {request.param} is not available")
    return request.param


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


def test_service_traffic_through_strict_nodes(strict_lab, k8s, proxy):
    lab = strict_lab
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


# ---- every NodePort allocated; a spoofed SYN flood (issue 26) ---------------------------------
def pod_on_node2(lab, k8s) -> str:
    """An echo pod (app=web) on node 2, ready; its name."""
    k8s.pod("remote", labels={"app": "web"}, node_name=lab.node(2).name)
    return k8s.ready_pods("app=web", 1)[0]["metadata"]["name"]


def node_ports_held(api) -> dict[int, str]:
    """Every NodePort of the cluster -> "namespace/service"."""
    from kubernetes import client
    items = json.loads(client.CoreV1Api(api).list_service_for_all_namespaces(_preload_content=False).data)["items"]
    return {p["nodePort"]: f'{s["metadata"]["namespace"]}/{s["metadata"]["name"]}'
            for s in items for p in s["spec"].get("ports", []) if p.get("nodePort")}


def api_error(exc) -> str:
    return f'{getattr(exc, "status", "")} {getattr(exc, "body", exc)}'


def allocate_every_node_port(k8s) -> list[int]:
    """Hold every NodePort of NODE_PORTS in *k8s*'s namespace, each a Service port to the
    app=web pods: first Services of up to 50 ports (an EndpointSlice holds 100) given the
    free ports by number, then one-port Services the API server allocates until it refuses
    ("range is full"). Waits first until earlier tests' NodePorts (their namespaces are
    being deleted) are released. Returns the NodePorts held."""
    api = k8s.api
    in_range = set(range(NODE_PORTS[0], NODE_PORTS[1] + 1))

    def others_released():
        return not [p for p, owner in node_ports_held(api).items() if not owner.startswith(k8s.name + "/")]
    kube.wait_for(others_released, 120, "earlier tests' NodePorts released", interval=1)
    free = sorted(in_range - set(node_ports_held(api)))
    for i in range(0, len(free), 50):
        k8s.service(f"fill-{i // 50}", selector={"app": "web"}, type="NodePort",
                    ports=[{"name": f"p{n}", "port": n, "targetPort": "tcp", "protocol": "TCP", "nodePort": n}
                           for n in free[i:i + 50]])
    refused = None
    for i in range(len(in_range) + 1):
        try:
            k8s.service(f"more-{i}", selector={"app": "web"}, type="NodePort",
                        ports=[{"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"}])
        except Exception as exc:  # noqa: BLE001
            refused = api_error(exc)
            break
    assert refused and "range is full" in refused, f"the API server still allocates NodePorts: {refused}"
    mine = sorted(p for p, owner in node_ports_held(api).items() if owner.startswith(k8s.name + "/"))
    assert in_range <= set(mine), f"not held here: {sorted(in_range - set(mine))}"
    return mine


def connections(ns: str, addr: str, port: int, count: int, ports: bool) -> tuple[Counter, int]:
    """*count* new TCP connections, one request each (3 s to connect and answer). Returns a
    Counter of (pod, the client address it saw, where the client port it saw is:
    "nodeport", "masq" (MASQ_PORTS) or "other"; "-" unless *ports*), failures as ("error",
    name, ""), and how many connections retransmitted their SYN (TCP_INFO total_retrans)."""
    seen: Counter = Counter()
    retransmitted = 0
    for _ in range(count):
        try:
            with tcp_connect(ns, addr, port, timeout=3) as s:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                retransmitted += struct.unpack_from("I", info, 100)[0] > 0   # tcpi_total_retrans
                reply = tcp_exchange(s, "clientip").split()
            src, sport = reply[1].rsplit(":", 1)
            where = ("-" if not ports else "nodeport" if NODE_PORTS[0] <= int(sport) <= NODE_PORTS[1] else
                     "masq" if MASQ_PORTS[0] <= int(sport) <= MASQ_PORTS[1] else "other")
            seen[(reply[0], src, where)] += 1
        except OSError as exc:
            seen[("error", type(exc).__name__, "")] += 1
    return seen, retransmitted


def kxlb_counters(lab) -> dict:
    """Node 1's kxlb datapath counters that are not zero (`kxlb stats`; its pins are on the
    host's bpffs, which `ip netns exec` would hide)."""
    r = subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", lab.node(1).pin_dir, "stats", "--json"],
                       capture_output=True, text=True, timeout=60)
    try:
        return {k: v for k, v in json.loads(r.stdout)["datapath"].items() if v}
    except (ValueError, KeyError):
        return {"kxlb stats": (r.stdout + r.stderr)[-300:]}


def expect_all(proxy: str, what: str, seen: Counter, want: tuple, retransmitted: int, lab) -> None:
    bad = {k: v for k, v in seen.items() if k != want}
    counters = kxlb_counters(lab) if proxy == "kxlb" else {}
    print(f"{proxy}: {what}: {dict(seen)}; {retransmitted} retransmitted their SYN"
          + (f"; kxlb counters {counters}" if counters else ""))
    assert not bad, (f"{proxy}: {what}: {sum(bad.values())} failed or went wrong: {bad} "
                     f"(want {want}; {retransmitted} retransmitted their SYN) {counters}")


def test_every_node_port_allocated(strict_lab, k8s, proxy):
    """Every NodePort of the range allocated (and live, to the pod on node 2), then 500
    connections from the outside client through one of them on node 1 (masqueraded): all
    succeed, and with kxlb every one came from a masquerade port, none from a NodePort.
    kxlb 0.1 searched masquerade ports in 1024-32767, the default NodePort range included,
    and matched frontends before replies: a SYN-ACK to a masquerade port that was a live
    NodePort became a new flow, and about 1 connection in 11 failed with that range full.
    (kube-proxy masquerades fully-random: any port, netfilter's conntrack tells replies
    from new flows; its ports are not checked.)"""
    lab = strict_lab
    node1 = lab.node(1)
    name = pod_on_node2(lab, k8s)
    t0 = time.monotonic()
    mine = allocate_every_node_port(k8s)
    try:
        pending = set(mine)

        def all_answer():   # the proxy has programmed every one
            for p in sorted(pending):
                try:
                    if tcp_request(lab.client_ns, node1.ip, p, "clientip", timeout=2)[0].split()[0] == name:
                        pending.discard(p)
                except OSError:
                    pass
            return not pending
        try:
            kube.wait_for(all_answer, 120, "every NodePort answers", interval=0.5)
        except Exception:
            pytest.fail(f"{proxy}: NodePorts not answering through node 1: {sorted(pending)}")
        print(f"{proxy}: {len(mine)} NodePorts allocated, all answering, in {time.monotonic() - t0:.1f}s")
        t1 = time.monotonic()
        seen, retransmitted = connections(lab.client_ns, node1.ip, mine[len(mine) // 2], 500, ports=proxy == "kxlb")
        expect_all(proxy, f"500 connections ({time.monotonic() - t1:.1f}s)", seen,
                   (name, node1.ip, "masq" if proxy == "kxlb" else "-"), retransmitted, lab)
    finally:
        # Give the range back now (a namespace takes its time to go), for the next test.
        from kubernetes import client
        core = client.CoreV1Api(k8s.api)
        for svc in json.loads(core.list_namespaced_service(k8s.name, _preload_content=False).data)["items"]:
            core.delete_namespaced_service(svc["metadata"]["name"], k8s.name, _preload_content=False)


# The spoofed SYNs: raw IPv4+TCP from the outside client's namespace (IP_HDRINCL: the kernel
# fills in the IP checksum and total length), at a fixed rate, each from a random address
# of argv[5] and a random port, with a random sequence number.
FLOOD = r"""
import random, socket, struct, sys, time

dst, dport, count, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
hosts = [socket.inet_aton(h) for h in sys.argv[5].split(",")]
d = socket.inet_aton(dst)

def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff

s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
start = time.monotonic()
for i in range(count):
    src = random.choice(hosts)
    tcp = struct.pack("!HHIIBBHHH", random.randint(1024, 65535), dport, random.getrandbits(32), 0,
                      5 << 4, 0x02, 64240, 0, 0)
    tcp = tcp[:16] + struct.pack("!H", csum(src + d + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 0, random.getrandbits(16), 0, 64, 6, 0, src, d)
    s.sendto(ip + tcp, (dst, 0))
    ahead = start + (i + 1) / rate - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
print(count, round(time.monotonic() - start, 1))
"""
# The spoofed sources: the upper half of the fabric's /24, which no namespace of the lab
# has (nodes are .11, .12, ..., the client .100): node 1 routes them back onto the fabric,
# where nobody answers its ARP for them, so the backend's SYN-ACKs go nowhere and every SYN
# leaves a half-open flow. Nothing leaves the lab's namespaces.
SPOOF_HOSTS = [str(a) for a in list(ipaddress.ip_network(FABRIC_CIDR).hosts())[127:]]
# Bounded: 4000 SYNs in 2 s. Over KXLB_FLOOD_NEW_PER_TICK (1024 new masqueraded flows in
# a tick on a CPU; the sender and the softirqs that carry its packets share one), so kxlb
# counts a flood.
FLOOD_SYNS, FLOOD_RATE = 4000, 2000.0


def tcp_in_segments(lab, target: str) -> int:
    """Tcp InSegs of a target's namespace (/proc/net/snmp)."""
    r = lab.run_in(target, ["cat", "/proc/net/snmp"], timeout=30)
    tcp = [line.split() for line in r.stdout.splitlines() if line.startswith("Tcp:")]
    return int(tcp[1][tcp[0].index("InSegs")])


def test_spoofed_syn_flood(strict_lab, k8s, proxy):
    """A spoofed SYN flood at a masqueraded frontend (node 1's NodePort, its pod on node 2),
    FLOOD_SYNS at FLOOD_RATE from SPOOF_HOSTS (inside the lab), then 150 legitimate
    connections from the outside client: all succeed. kxlb 0.1 kept half-open flows 6 hours;
    until this test a search took the first reclaimable port it met in a flood period, one
    whose half-open flow the backend still held in SYN_RECV: connections right after the
    flood retransmitted their SYNs, and one in 150 timed out (docs/datapath.md, "Under a
    flood")."""
    lab = strict_lab
    node1 = lab.node(1)
    name = pod_on_node2(lab, k8s)

    def create():
        try:
            return k8s.service("web", selector={"app": "web"}, type="NodePort",
                               ports=[{"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"}])
        except Exception as exc:  # noqa: BLE001
            if "range is full" in api_error(exc):
                return None     # the previous test's Services are still going away
            raise
    np = kube.wait_for(create, 60, "a free NodePort", interval=1)["spec"]["ports"][0]["nodePort"]
    settle_then_check(f"{proxy}: node 1's NodePort from outside",
                      lambda: answers(lab.client_ns, node1.ip, np), {(name, node1.ip)})

    backend = f"{k8s.name}/{name}"
    before = tcp_in_segments(lab, backend)
    r = lab.run_in("client", [sys.executable, "-c", FLOOD, node1.ip, str(np), str(FLOOD_SYNS), str(FLOOD_RATE),
                              ",".join(SPOOF_HOSTS)], timeout=120)
    assert r.returncode == 0, r.stderr
    reached = tcp_in_segments(lab, backend) - before
    print(f"{proxy}: flood of {r.stdout.strip()} (SYNs, seconds); segments the backend received: {reached}")
    # Most of it: on a busy machine a veth's backlog drops some of a 2000/s burst (CI, with
    # the Vagrant VM's QEMU beside it, once delivered 2989 of 4000 through kube-proxy). Half
    # is still twice what kxlb counts as a flood in a tick, and thousands of half-open flows.
    assert reached >= 0.5 * FLOOD_SYNS, f"{proxy}: the flood did not reach the backend: {reached} segments"

    t1 = time.monotonic()
    seen, retransmitted = connections(lab.client_ns, node1.ip, np, 150, ports=proxy == "kxlb")
    expect_all(proxy, f"150 connections after the flood ({time.monotonic() - t1:.1f}s)", seen,
               (name, node1.ip, "masq" if proxy == "kxlb" else "-"), retransmitted, lab)
