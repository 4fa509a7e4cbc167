"""kube-proxy's own packet-flow tables (pkg/proxy/nftables/proxier_test.go, Kubernetes
v1.37.1, the ``runPacketFlowTests`` calls), written down as data for the lab, where they
are replayed with real packets (tests/lab/test_packet_flow.py, docs/packet-flow.md).

Upstream's node under test ("test-node", 192.168.0.2) is lab node 1. Symbols:

sources
    ``pod``       a pod on node 1 that is no endpoint (upstream 10.0.0.2 / 10.180.0.2)
    ``l1``...     that endpoint pod itself (hairpin rows)
    ``node``      the host network of node 1 (upstream testNodeIP as source)
    ``external``  the lab's outside client (upstream testExternalClient 203.0.113.2)
    ``blocked``   a second address of the outside client, outside the
                  loadBalancerSourceRanges (upstream testExternalClientBlocked)
destinations
    ``cluster_ip:SVC``, ``lb_ip:SVC``, ``external_ip:SVC``, ``node_ip`` (node 1's IP),
    ``unallocated`` (an address of the service CIDR no Service holds)
ports
    a number, or ``np:SVC`` (the Service's allocated nodePort: upstream 3001...)
endpoints (real echo pods; the EndpointSlices are written by hand)
    ``l1``..``l4`` pods on node 1 (upstream testNodeName), ``r1``..``r3`` pods on node 2
    (upstream "other-node", "node1", "node2", "another-node", "remote": any node but
    the one under test)
output
    a frozenset of endpoint symbols, or "REJECT", "DROP"; masq: whether the endpoint
    sees another source address than the one the client sent from.

IPv6 (the lab is dual-stack): TestNodePorts/ipv6 is ported as its own scenario, with
IPv6 SingleStack Services, IPv6 EndpointSlices of the same pods, node 1's IPv6 address
and the client's. The other tables are IPv4-only upstream.

Left out (cannot be expressed in the lab):
- SCTP rows (the lab's echo pods serve TCP and UDP only);
- TestNodePorts "secondary nodeIP ignores NodePorts" / "external to nodePort on
  secondary IP" (output ""/accepted on a second node IP): lab nodes have one IP and the
  lab's kube-proxy runs with default --nodeport-addresses;
- TestLoadBalancer "same node to LBn, SNATted to LBn (implicitly allowed)": needs the
  LB IP assigned on the node as a source address (a cloud's job, not the lab's);
- TestLoadBalancer has two ingress IPs; the lab's pool assigns one per Service, so LB2
  rows are left out (they are the LB1 rows again);
- TestInternalExternalMasquerade sub-tests "no LocalTrafficDetector", "masqueradeAll"
  and "masqueradeAll, no LocalTrafficDetector": need other kube-proxy flags than the
  lab's (--cluster-cidr, no --masquerade-all); the "base" sub-test is ported.

TestInternalTrafficPolicy / TestTerminatingEndpoints*: the "after the slice is deleted"
rows are ported as ``after_delete`` of each case.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

REJECT, DROP = "REJECT", "DROP"

# endpoint conditions: (ready, serving, terminating)
READY = (True, True, False)
SERVING_TERMINATING = (False, True, True)
TERMINATING = (False, False, True)

# the echo pods' container ports (lab/kube.py ECHO_PORTS): tcp and udp echo on 8080
ECHO_PORT = 8080


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    dest: str
    port: Union[int, str]
    output: Union[frozenset, str]
    masq: bool = False
    proto: str = "TCP"
    xfail_kxlb: Optional[str] = None


def eps(*names: str) -> frozenset:
    return frozenset(names)


@dataclass(frozen=True)
class Svc:
    """A selector-less Service. ports: (name, port, protocol)."""
    type: str = "ClusterIP"
    ports: tuple = (("p80", 80, "TCP"),)
    etp: Optional[str] = None
    itp: Optional[str] = None
    external_ip: bool = False
    source_ranges: tuple = ()   # symbols: "node", "external"


@dataclass(frozen=True)
class Scenario:
    name: str
    upstream: str
    services: dict             # short name -> Svc
    endpoints: dict            # short name -> ((pod symbol, conditions), ...); no key: no slice
    rows: tuple
    after_delete: tuple = ()   # rows checked again once the EndpointSlices are deleted
    family: str = "IPv4"       # IPv6: SingleStack IPv6 Services, addressType IPv6 slices


def _ready(*pods: str) -> tuple:
    return tuple((p, READY) for p in pods)


LB_EXT = Svc(type="LoadBalancer", external_ip=True)

# ---- TestNoEndpointsReject -------------------------------------------------------------
NO_ENDPOINTS = Scenario(
    "no-endpoints-reject", "TestNoEndpointsReject",
    {"s": LB_EXT}, {},
    (
        Row("pod to cluster IP with no endpoints", "pod", "cluster_ip:s", 80, REJECT),
        Row("external to external IP with no endpoints", "external", "external_ip:s", 80, REJECT),
        Row("pod to NodePort with no endpoints", "pod", "node_ip", "np:s", REJECT),
        Row("external to NodePort with no endpoints", "external", "node_ip", "np:s", REJECT),
        Row("pod to LoadBalancer IP with no endpoints", "pod", "lb_ip:s", 80, REJECT),
        Row("external to LoadBalancer IP with no endpoints", "external", "lb_ip:s", 80, REJECT),
    ))

# ---- TestClusterIPGeneral ----------------------------------------------------------------
CLUSTER_IP_GENERAL = Scenario(
    "cluster-ip-general", "TestClusterIPGeneral",
    {"s1": Svc(ports=(("http", 80, "TCP"),)),
     "s2": Svc(ports=(("http", 80, "TCP"), ("https", 443, "TCP"), ("dns-udp", 53, "UDP"),
                      ("dns-tcp", 53, "TCP")))},  # dns-sctp left out (SCTP)
    {"s1": _ready("l1"), "s2": _ready("l1", "r1")},
    (
        Row("simple clusterIP", "pod", "cluster_ip:s1", 80, eps("l1")),
        Row("hairpin to cluster IP", "l1", "cluster_ip:s1", 80, eps("l1"), masq=True),
        Row("clusterIP with multiple endpoints", "pod", "cluster_ip:s2", 80, eps("l1", "r1")),
        Row("clusterIP with TargetPort", "pod", "cluster_ip:s2", 443, eps("l1", "r1")),
        Row("clusterIP with TCP, UDP on same port (TCP)", "pod", "cluster_ip:s2", 53, eps("l1", "r1")),
        Row("clusterIP with TCP, UDP on same port (UDP)", "pod", "cluster_ip:s2", 53, eps("l1", "r1"),
            proto="UDP"),
        Row("TCP-only port does not match UDP traffic", "pod", "cluster_ip:s2", 80, REJECT, proto="UDP"),
        Row("svc1 does not accept svc2's ports", "pod", "cluster_ip:s1", 443, REJECT),
        Row("packet to unallocated cluster ip", "pod", "unallocated", 80, DROP),
    ))

# ---- TestLoadBalancer (loadBalancerSourceRanges: node 1's address, the outside client) ----
LOAD_BALANCER = Scenario(
    "load-balancer", "TestLoadBalancer",
    {"s": Svc(type="LoadBalancer", source_ranges=("node", "external"))},
    {"s": _ready("l1")},
    (
        Row("pod to cluster IP", "pod", "cluster_ip:s", 80, eps("l1")),
        Row("external to nodePort", "external", "node_ip", "np:s", eps("l1"), masq=True),
        Row("nodePort bypasses LoadBalancerSourceRanges", "blocked", "node_ip", "np:s", eps("l1"), masq=True),
        Row("accepted external to LB1", "external", "lb_ip:s", 80, eps("l1"), masq=True),
        Row("blocked external to LB1", "blocked", "lb_ip:s", 80, DROP),
        Row("pod to LB1 (blocked by LoadBalancerSourceRanges)", "pod", "lb_ip:s", 80, DROP),
        Row("node to LB1 (allowed by LoadBalancerSourceRanges)", "node", "lb_ip:s", 80, eps("l1"), masq=True),
    ))

# ---- TestNodePorts (ipv4) ---------------------------------------------------------------
NODE_PORTS = Scenario(
    "node-ports", "TestNodePorts/ipv4",
    {"s": Svc(type="NodePort")},
    {"s": _ready("r1", "l1")},
    (
        Row("pod to cluster IP", "pod", "cluster_ip:s", 80, eps("l1", "r1")),
        Row("external to nodePort", "external", "node_ip", "np:s", eps("l1", "r1"), masq=True),
        Row("node to nodePort", "node", "node_ip", "np:s", eps("l1", "r1"), masq=True),
    ))

# ---- TestNodePorts (ipv6) ---------------------------------------------------------------
NODE_PORTS6 = Scenario(
    "node-ports-ipv6", "TestNodePorts/ipv6",
    NODE_PORTS.services, NODE_PORTS.endpoints, NODE_PORTS.rows, family="IPv6")

# ---- TestExternalTrafficPolicyLocal / Cluster -----------------------------------------------
_BOTH = eps("l1", "r1")


def _etp_rows(local: bool) -> tuple:
    m = not local
    return (
        Row("pod to cluster IP hits both endpoints, unmasqueraded", "pod", "cluster_ip:s", 80, _BOTH),
        Row("pod to external IP hits both endpoints", "pod", "external_ip:s", 80, _BOTH, masq=m),
        Row("external to external IP", "external", "external_ip:s", 80, eps("l1") if local else _BOTH, masq=m),
        Row("pod to LB IP hits both endpoints", "pod", "lb_ip:s", 80, _BOTH, masq=m),
        Row("external to LB IP", "external", "lb_ip:s", 80, eps("l1") if local else _BOTH, masq=m),
        Row("pod to NodePort hits both endpoints", "pod", "node_ip", "np:s", _BOTH, masq=m),
        Row("external to NodePort", "external", "node_ip", "np:s", eps("l1") if local else _BOTH, masq=m),
    )


ETP_LOCAL = Scenario(
    "etp-local", "TestExternalTrafficPolicyLocal",
    {"s": Svc(type="LoadBalancer", external_ip=True, etp="Local")},
    {"s": _ready("r1", "l1")}, _etp_rows(True))
ETP_CLUSTER = Scenario(
    "etp-cluster", "TestExternalTrafficPolicyCluster",
    {"s": Svc(type="LoadBalancer", external_ip=True, etp="Cluster")},
    {"s": _ready("r1", "l1")}, _etp_rows(False))

# ---- TestInternalTrafficPolicy ---------------------------------------------------------
_ITP_DELETED = (Row("endpoints deleted", "pod", "cluster_ip:s", 80, REJECT),)


def _itp(name: str, itp: str, pods: tuple, output) -> Scenario:
    return Scenario(f"itp-{name}", f"TestInternalTrafficPolicy/{name}",
                    {"s": Svc(itp=itp)}, {"s": _ready(*pods)},
                    (Row(f"pod to ClusterIP ({name})", "pod", "cluster_ip:s", 80, output),),
                    _ITP_DELETED)


ITP = [
    _itp("cluster", "Cluster", ("l1", "r1", "r2"), eps("l1", "r1", "r2")),
    _itp("local-one-local", "Local", ("l1", "r1", "r2"), eps("l1")),
    _itp("local-multiple-local", "Local", ("l1", "l2", "r1"), eps("l1", "l2")),
    _itp("local-no-local", "Local", ("r1", "r2", "r3"), DROP),
]

# ---- TestTerminatingEndpointsTrafficPolicyLocal / Cluster ----------------------------------
# upstream 10.0.1.1-4 on testNodeName -> l1-l4; 10.0.1.5 on "node-1" -> r1;
# (Cluster) 10.0.1.3/.4 on "another-node" -> r2/r3.
_TERM_DELETED = (Row("pod to clusterIP after endpoints deleted", "pod", "cluster_ip:s", 80, REJECT),
                 Row("external to LB after endpoints deleted", "external", "lb_ip:s", 80, REJECT))


def _term(etp: str, case: str, endpoints: tuple, pod_out, ext_out) -> Scenario:
    ext_masq = etp == "Cluster" and ext_out not in (REJECT, DROP)
    return Scenario(f"term-{etp.lower()}-{case}", f"TestTerminatingEndpointsTrafficPolicy{etp}/{case}",
                    {"s": Svc(type="LoadBalancer", etp=etp)}, {"s": endpoints},
                    (Row("pod to clusterIP", "pod", "cluster_ip:s", 80, pod_out),
                     Row("external to LB", "external", "lb_ip:s", 80, ext_out, masq=ext_masq)),
                    _TERM_DELETED)


TERMINATING = [
    _term("Local", "ready-endpoints-exist",
          (("l1", READY), ("l2", READY), ("l3", SERVING_TERMINATING), ("l4", TERMINATING), ("r1", READY)),
          eps("l1", "l2", "r1"), eps("l1", "l2")),
    _term("Local", "only-terminating-endpoints-exist",
          (("l2", SERVING_TERMINATING), ("l3", SERVING_TERMINATING), ("l4", TERMINATING), ("r1", READY)),
          eps("r1"), eps("l2", "l3")),
    _term("Local", "terminating-endpoints-on-remote-node",
          (("r1", SERVING_TERMINATING),), eps("r1"), DROP),
    _term("Local", "no-usable-endpoints-on-any-node",
          (("l1", TERMINATING), ("r1", TERMINATING)), REJECT, REJECT),
    _term("Cluster", "ready-endpoints-exist",
          (("l1", READY), ("l2", READY), ("r2", SERVING_TERMINATING), ("r3", TERMINATING), ("r1", READY)),
          eps("l1", "l2", "r1"), eps("l1", "l2", "r1")),
    _term("Cluster", "only-terminating-endpoints-exist",
          (("l2", SERVING_TERMINATING), ("l3", SERVING_TERMINATING), ("r2", TERMINATING),
           ("r1", SERVING_TERMINATING)),
          eps("l2", "l3", "r1"), eps("l2", "l3", "r1")),
    _term("Cluster", "terminating-endpoints-on-remote-node",
          (("r1", SERVING_TERMINATING),), eps("r1"), eps("r1")),
    _term("Cluster", "no-usable-endpoints-on-any-node",
          (("l1", TERMINATING), ("r1", TERMINATING)), REJECT, REJECT),
]

# ---- TestInternalExternalMasquerade, sub-test "base" ---------------------------------------
# svc1 -> "a" (endpoints l1, r1), svc2 (eTP Local) -> "b" (l2, r2), svc3 (iTP Local) -> "c" (l3, r3)
_A, _B, _C = eps("l1", "r1"), eps("l2", "r2"), eps("l3", "r3")
INTERNAL_EXTERNAL_MASQ = Scenario(
    "internal-external-masquerade", "TestInternalExternalMasquerade/base",
    {"a": Svc(type="LoadBalancer"), "b": Svc(type="LoadBalancer", etp="Local"),
     "c": Svc(type="LoadBalancer", itp="Local")},
    {"a": _ready("l1", "r1"), "b": _ready("l2", "r2"), "c": _ready("l3", "r3")},
    (
        Row("pod to ClusterIP", "pod", "cluster_ip:a", 80, _A),
        Row("pod to NodePort", "pod", "node_ip", "np:a", _A, masq=True),
        Row("pod to LB", "pod", "lb_ip:a", 80, _A, masq=True),
        Row("node to ClusterIP", "node", "cluster_ip:a", 80, _A, masq=True),
        Row("node to NodePort", "node", "node_ip", "np:a", _A, masq=True),
        Row("node to LB", "node", "lb_ip:a", 80, _A, masq=True),
        Row("external to ClusterIP", "external", "cluster_ip:a", 80, _A, masq=True),
        Row("external to NodePort", "external", "node_ip", "np:a", _A, masq=True),
        Row("external to LB", "external", "lb_ip:a", 80, _A, masq=True),
        Row("pod to ClusterIP with eTP:Local", "pod", "cluster_ip:b", 80, _B),
        Row("pod to NodePort with eTP:Local", "pod", "node_ip", "np:b", _B),
        Row("pod to LB with eTP:Local", "pod", "lb_ip:b", 80, _B),
        Row("node to ClusterIP with eTP:Local", "node", "cluster_ip:b", 80, _B, masq=True),
        # upstream sends this one to svc1's nodePort (3001), so svc1's endpoints answer
        Row("node to NodePort with eTP:Local", "node", "node_ip", "np:a", _A, masq=True),
        Row("node to LB with eTP:Local", "node", "lb_ip:b", 80, _B, masq=True),
        Row("external to ClusterIP with eTP:Local", "external", "cluster_ip:b", 80, _B, masq=True),
        Row("external to NodePort with eTP:Local", "external", "node_ip", "np:b", eps("l2")),
        Row("external to LB with eTP:Local", "external", "lb_ip:b", 80, eps("l2")),
        Row("pod to ClusterIP with iTP:Local", "pod", "cluster_ip:c", 80, eps("l3")),
        Row("pod to NodePort with iTP:Local", "pod", "node_ip", "np:c", _C, masq=True),
        Row("pod to LB with iTP:Local", "pod", "lb_ip:c", 80, _C, masq=True),
        Row("node to ClusterIP with iTP:Local", "node", "cluster_ip:c", 80, eps("l3"), masq=True),
        Row("node to NodePort with iTP:Local", "node", "node_ip", "np:c", _C, masq=True),
        Row("node to LB with iTP:Local", "node", "lb_ip:c", 80, _C, masq=True),
        Row("external to ClusterIP with iTP:Local", "external", "cluster_ip:c", 80, eps("l3"), masq=True),
        Row("external to NodePort with iTP:Local", "external", "node_ip", "np:c", _C, masq=True),
        Row("external to LB with iTP:Local", "external", "lb_ip:c", 80, _C, masq=True),
    ))

SCENARIOS = [NO_ENDPOINTS, CLUSTER_IP_GENERAL, LOAD_BALANCER, NODE_PORTS, NODE_PORTS6, ETP_LOCAL, ETP_CLUSTER,
             *ITP, *TERMINATING, INTERNAL_EXTERNAL_MASQ]

# Pods the scenarios use: endpoints l1-l4 on node 1, r1-r3 on node 2, source "pod" on node 1.
LOCAL_PODS = ("l1", "l2", "l3", "l4")
REMOTE_PODS = ("r1", "r2", "r3")
SOURCE_POD = "pod"

# One probe batch, run inside the source's network namespace (and, for the host network of a
# node, its cgroup): argv[1] is JSON {addr, port, proto, tries, min, bind, timeout, want}; prints a
# JSON list of [outcome, source the endpoint saw, our own source address]. It stops at the
# first outcome outside `want`, and once every wanted outcome was seen in at least `min` tries.
PROBE = r'''
import json, socket, sys
a = json.loads(sys.argv[1])
want, seen, out = set(a["want"]), set(), []
for _ in range(a["tries"]):
    kind = socket.SOCK_STREAM if a["proto"] == "TCP" else socket.SOCK_DGRAM
    s = socket.socket(socket.AF_INET6 if ":" in a["addr"] else socket.AF_INET, kind)
    s.settimeout(a["timeout"])
    try:
        if a["bind"]:
            s.bind((a["bind"], 0))
        s.connect((a["addr"], a["port"]))
        me = s.getsockname()[0]
        if kind == socket.SOCK_STREAM:
            s.sendall(b"clientip\n")
            buf = b""
            while not buf.endswith(b"\n"):
                c = s.recv(4096)
                if not c:
                    raise ConnectionResetError("closed")
                buf += c
        else:
            s.send(b"clientip")
            buf = s.recv(4096)
        name, peer = buf.decode().split()[:2]
        out.append([name, peer.rsplit(":", 1)[0], me])
    except ConnectionRefusedError:
        out.append(["REJECT", "", ""])
    except (socket.timeout, TimeoutError):
        out.append(["DROP", "", ""])
    except OSError as e:
        out.append(["ERROR:" + type(e).__name__ + ":" + str(e.errno), "", ""])
    finally:
        s.close()
    seen.add(out[-1][0])
    if out[-1][0] not in want or (seen == want and len(out) >= a["min"]):
        break
print(json.dumps(out))
'''
