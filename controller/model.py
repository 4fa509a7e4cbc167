"""Desired datapath state from Services and EndpointSlices: pure logic, no I/O.

The rules are kube-proxy v1.37's (pkg/proxy: serviceport.go, endpointslicecache.go,
topology.go, nftables/proxier.go): see ../shared/reference/service-proxy-semantics.md
and docs/controller.md. Function names in comments are kube-proxy's.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import NamedTuple

from kxlb.loader.layout import PROTOS, Backend, ServiceKey
from kxlb.loader.svcspec import Frontend, Kind, LbService

IPV4, IPV6 = "IPv4", "IPv6"   # EndpointSlice addressType, and the families of a dual-stack Service
LOCAL = "Local"


# Small value types are NamedTuples: a 10k-service sync makes ~100k of them, and tuple
# construction is several times cheaper than a frozen dataclass's.
class ServicePort(NamedTuple):
    name: str        # "" for a single unnamed port
    port: int
    protocol: str    # "TCP", "UDP", "SCTP"
    node_port: int = 0   # 0: none


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    type: str = "ClusterIP"
    cluster_ips: tuple[str, ...] = ()
    ports: tuple[ServicePort, ...] = ()
    external_ips: tuple[str, ...] = ()                    # valid IPs only (IPv4 and IPv6)
    lb_ingress: tuple[tuple[str, str | None], ...] = ()   # status.loadBalancer.ingress: (ip, ipMode)
    lb_source_ranges: tuple[str, ...] = ()                # raw, as written (kube-proxy trims and parses)
    external_traffic_policy: str = "Cluster"
    internal_traffic_policy: str = "Cluster"
    session_affinity: str = "None"
    affinity_timeout: int = 10800
    traffic_distribution: str | None = None   # informational: the proxy only reads the hints
    health_check_node_port: int = 0

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def headless(self) -> bool:
        return not self.cluster_ips or self.cluster_ips[0] == "None"


class Endpoint(NamedTuple):
    address: str     # addresses[0]: kube-proxy uses only the first
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node: str | None = None
    zone_hints: tuple[str, ...] = ()   # hints.forZones[].name
    node_hints: tuple[str, ...] = ()   # hints.forNodes[].name


class SlicePort(NamedTuple):
    name: str | None   # None (absent): kube-proxy ignores the port
    port: int | None
    protocol: str


@dataclass(frozen=True)
class EndpointSlice:
    namespace: str
    name: str
    service: str               # label kubernetes.io/service-name
    address_type: str = IPV4
    endpoints: tuple[Endpoint, ...] = ()
    ports: tuple[SlicePort, ...] = ()

    @property
    def service_id(self) -> str:
        return f"{self.namespace}/{self.service}"


@dataclass(frozen=True)
class NodeContext:
    """What the rules need to know about the node they run on."""

    name: str                           # endpoints with this nodeName are local
    zone: str | None = None             # label topology.kubernetes.io/zone
    nodeport_addresses: tuple[str, ...] = ()   # addresses (both families) NodePorts listen on
    ip: str | None = None               # primary IPv4 (allowFromNode on source ranges)
    ip6: str | None = None              # primary IPv6 (the same for IPv6 service ports)

    def ip_of(self, family: str) -> str | None:
        return self.ip6 if family == IPV6 else self.ip


def _no_local() -> dict[str, int]:
    return {"internal": 0, "external": 0}


@dataclass
class Desired:
    """What the maps should hold, and why some of it is missing."""

    services: dict[ServiceKey, LbService] = field(default_factory=dict)   # by LbService.key
    owners: dict[ServiceKey, str] = field(default_factory=dict)   # key -> "ns/name:port"
    skipped: list[str] = field(default_factory=list)              # human-readable reasons
    # ("ns/name", family) -> (healthCheckNodePort, unique local ready endpoint IPs of the
    # family): kube-proxy's proxier of each family has its own health check servers
    health_checks: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    # service ports whose Local policy has no local endpoint while others exist
    # (kube-proxy's sync_proxy_rules_no_local_endpoints_total{traffic_policy})
    no_local: dict[str, int] = field(default_factory=_no_local)
    # UDP service ports -> their serving endpoints (all of them: kube-proxy's conntrack
    # cleanup keeps flows to any serving endpoint, whatever the policies use)
    udp_serving: dict[ServiceKey, frozenset[Backend]] = field(default_factory=dict)


# --- addresses, parsed as Kubernetes does ------------------------------------------------

def _is_ipv4(ip: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, ip)
        return True
    except (OSError, TypeError):
        return False


def family_of(ip: str) -> str:
    """IPV4 or IPV6 of an address the decoder has already validated."""
    return IPV6 if ":" in ip else IPV4


_DOTTED = re.compile(r"([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)")
_V4_MAPPED = bytes(10) + b"\xff\xff"


def ipv4_sloppy(text: str) -> str | None:
    """``text`` as kube-proxy's ParseIPSloppy reads it, normalised, if that is IPv4.

    Kubernetes stored addresses with leading zeros before Go rejected them ("010.0.0.1"
    is ten, not octal), and Go counts an IPv4-mapped IPv6 address as IPv4. Only called
    when inet_pton has already refused ``text``, so the common path stays C-fast."""
    m = _DOTTED.fullmatch(text)
    if m:
        try:
            octets = [int(g) for g in m.groups()]
        except ValueError:   # thousands of digits: Go gives up too
            return None
        return ".".join(map(str, octets)) if max(octets) <= 255 else None
    try:
        raw = socket.inet_pton(socket.AF_INET6, text)
    except (OSError, TypeError):
        return None
    return socket.inet_ntoa(raw[12:]) if raw[:12] == _V4_MAPPED else None


def _cidr_sloppy(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """ParseCIDRSloppy: the network (host bits cleared), None for garbage. An IPv4-mapped
    IPv6 address with a prefix length of 96 or more is IPv4 to Go, as ipv4_sloppy."""
    addr, slash, bits = text.partition("/")
    # a prefix length is plain decimal digits (Go's dtoi gives up at 0xFFFFFF)
    if not (slash and bits.isascii() and bits.isdigit() and len(bits) <= 7):
        return None
    n = int(bits)
    if ":" in addr:
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            return None
        return ipaddress.IPv6Network((addr, n), strict=False) if n <= 128 else None
    ip = addr if _is_ipv4(addr) else ipv4_sloppy(addr)
    return ipaddress.IPv4Network((ip, n), strict=False) if ip is not None and n <= 32 else None


# --- endpoints ------------------------------------------------------------------------

def _addr_order(item: tuple[Backend, Endpoint]) -> tuple[bytes, int]:
    addr = item[0].addr
    return socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr), item[0].port


def merged_endpoints(name: str | None, protocol: str, slices: list[EndpointSlice],
                     family: str = IPV4) -> list[tuple[Backend, Endpoint]]:
    """Every endpoint of one family of one slice port (name, protocol) over all slices
    (of that addressType), as kube-proxy's endpointInfoByServicePort/addEndpoints merge
    them, sorted by address.

    Slice ports match by name (a named targetPort resolves per slice); the same ip:port
    in two slices: the later one wins unless it is terminating (so a running pod beats a
    terminating one that had its IP). Sorted: every node and every restart lays the slots
    out the same way, so the flow hash picks the same backend everywhere."""
    seen: dict[Backend, Endpoint] = {}
    for s in slices:
        if s.address_type != family:
            continue
        for sp in s.ports:
            if sp.name != name or sp.protocol != protocol or not sp.port:
                continue
            for ep in s.endpoints:
                b = Backend(ep.address, sp.port)
                if not ep.terminating or b not in seen:
                    seen[b] = ep
    return sorted(seen.items(), key=_addr_order)


def _topology_mode(eps: list[tuple[Backend, Endpoint]], node: str, zone: str | None) -> str:
    """topologyModeFromHints. The proxy never reads spec.trafficDistribution: it only
    consumes the hints the EndpointSlice controller wrote. Node hints first
    (PreferSameTrafficDistribution is GA and locked on in v1.37), then zone hints; each
    only if every ready endpoint carries one and some endpoint is hinted here."""
    # Fast exit for the common unhinted service: the first ready endpoint decides that
    # neither "every ready endpoint has a hint" can hold.
    for _, ep in eps:
        if ep.ready:
            if not ep.node_hints and not ep.zone_hints:
                return ""
            break
    else:
        return ""   # no ready endpoint, no hints to consider
    ready = [ep for _, ep in eps if ep.ready]
    if all(ep.node_hints for ep in ready) and any(node in ep.node_hints for ep in ready):
        return "PreferSameNode"
    if all(ep.zone_hints for ep in ready) and any(zone in ep.zone_hints for ep in ready):
        return "PreferSameZone"
    return ""


def categorize(eps: list[tuple[Backend, Endpoint]], uses_cluster: bool, uses_local: bool,
               node: NodeContext) -> tuple[tuple[Backend, ...], tuple[Backend, ...], bool]:
    """CategorizeEndpoints: (cluster set, local set, has any usable endpoint anywhere).

    Each set is the ready endpoints, else (independently) the serving+terminating ones;
    topology filters only the ready cluster set. A set the service never uses is empty."""
    cluster: tuple[Backend, ...] = ()
    local: tuple[Backend, ...] = ()
    has_any = False
    name, zone = node.name, node.zone   # None (no zone label) matches no hint
    if uses_cluster:
        mode = _topology_mode(eps, name, zone)
        if mode == "PreferSameNode":
            cluster = tuple([b for b, ep in eps if ep.ready and name in ep.node_hints])
        elif mode == "PreferSameZone":
            cluster = tuple([b for b, ep in eps if ep.ready and zone in ep.zone_hints])
        else:
            cluster = tuple([b for b, ep in eps if ep.ready])
        # No ready endpoint for the topology means none anywhere (the mode needs one), so
        # the fallback ignores topology.
        cluster = cluster or tuple([b for b, ep in eps if ep.serving and ep.terminating])
        has_any = bool(cluster)
    if uses_local:
        has_any = has_any or any(ep.ready or (ep.serving and ep.terminating) for _, ep in eps)
        # isLocal: an empty node name matches nothing
        mine = [(b, ep) for b, ep in eps if name and ep.node == name]
        local = (tuple([b for b, ep in mine if ep.ready])
                 or tuple([b for b, ep in mine if ep.serving and ep.terminating]))
    return cluster, local, has_any


def _local_ready_ips(slices: list[EndpointSlice], node_name: str, family: str) -> int:
    """LocalReadyEndpoints: unique IPs of local ready endpoints over every port the
    slices (of the family) carry, whether or not the Service defines it; what the health
    check reports."""
    if not node_name:
        return 0
    ports = {(sp.name, sp.protocol) for s in slices if s.address_type == family
             for sp in s.ports if sp.name is not None and sp.port}
    return len({b.addr for name, proto in ports for b, ep in merged_endpoints(name, proto, slices, family)
                if ep.ready and ep.node == node_name})


# --- services -------------------------------------------------------------------------

def _source_ranges(svc: Service, lb_ips: list[str], node: NodeContext, out: Desired,
                   family: str, report: bool) -> tuple[str, ...]:
    """loadBalancerSourceRanges of one family as that family's nftables proxier's
    firewall chain uses them (the field lists both families' ranges). ``report``: say
    which entries are garbage (once per Service, not per family)."""
    version = 6 if family == IPV6 else 4
    nets = []
    for i, raw in enumerate(svc.lb_source_ranges):
        text = raw.strip()   # validation lets whitespace padding through
        net = _cidr_sloppy(text)
        if net is None:
            if text and report:   # empty entries are ignored silently, as kube-proxy does
                out.skipped.append(f"Service {svc.id}: spec.loadBalancerSourceRanges[{i}] {raw!r} "
                                   "is not a CIDR; ignored")
        elif net.version == version:   # the other family's ranges are its proxier's
            nets.append(net)
    # A /0 means "allow any", the same as no ranges (serviceport.go IsZeroCIDR); and the
    # firewall only ever guards load-balancer IPs.
    if not lb_ips or any(n.prefixlen == 0 for n in nets):
        return ()
    ranges = [str(n) for n in nets]
    # allowFromNode: a VIP bound locally makes the node's own requests loop back with the
    # VIP as source, so the VIPs themselves must pass when the node is allowed.
    me = node.ip_of(family)
    if me and family_of(me) == family:
        addr = ipaddress.ip_address(me)
        if any(addr in n for n in nets):
            ranges += [f"{ip}/{8 * len(addr.packed)}" for ip in lb_ips]
    return tuple(ranges)


def _frontends(key: ServiceKey, port: ServicePort, lb_ips: list[str], ext_ips: list[str],
               nodeport_addrs: list[str]) -> tuple[Frontend, ...]:
    """The ways in besides the cluster IP, one per address:port. A load-balancer IP wins
    over an equal externalIP (it alone is subject to source ranges), either over a
    NodePort on the same address; kube-proxy programs a NodePort whenever one is
    allocated (the API allocates none for ClusterIP services)."""
    seen = {key}
    out = []
    for kind, addrs, p in ((Kind.LOAD_BALANCER, lb_ips, port.port), (Kind.EXTERNAL_IP, ext_ips, port.port),
                           (Kind.NODE_PORT, nodeport_addrs if port.node_port else (), port.node_port)):
        for addr in addrs:
            fk = ServiceKey(addr, p, key.proto)
            if fk not in seen:
                seen.add(fk)
                out.append(Frontend(fk, kind))
    return tuple(out)


def service_entries(svc: Service, slices: list[EndpointSlice], out: Desired, node: NodeContext) -> None:
    """Add one Service's service ports to ``out``: every port on each of its cluster IPs
    (one per family: a dual-stack Service has two), as kube-proxy's two proxiers of a
    dual-stack node each program their family's."""
    if svc.type == "ExternalName" or svc.headless:
        return
    # GetClusterIPByFamily: one cluster IP per family (the API allows no more)
    vips: dict[str, str] = {}
    for vip in svc.cluster_ips:
        vips.setdefault(family_of(vip), vip)
    for i, (family, vip) in enumerate(vips.items()):
        _family_entries(svc, family, vip, slices, out, node, first=i == 0)


def _family_entries(svc: Service, family: str, vip: str, slices: list[EndpointSlice], out: Desired,
                    node: NodeContext, first: bool) -> None:
    """One family's service ports of a Service (its cluster IP of that family x every
    port), with only that family's externalIPs, load-balancer IPs, NodePort addresses,
    source ranges and EndpointSlices."""
    sid = svc.id
    ext_ips = [ip for ip in svc.external_ips if family_of(ip) == family]
    # IsVIPMode: no ipMode means VIP; "Proxy" load balancers deliver to the node themselves
    lb_ips = [ip for ip, mode in svc.lb_ingress if mode in (None, "VIP") and family_of(ip) == family]
    ranges = _source_ranges(svc, lb_ips, node, out, family, first) if svc.lb_source_ranges else ()
    # apiservice.ExternalPolicyLocal goes by type (externalIPs count, in any family, only
    # for ClusterIP); the per-port ExternallyAccessible below goes by what exists.
    external_policy_local = svc.external_traffic_policy == LOCAL and (
        svc.type in ("NodePort", "LoadBalancer") or (svc.type == "ClusterIP" and bool(svc.external_ips)))
    internal_policy_local = svc.internal_traffic_policy == LOCAL
    affinity = svc.affinity_timeout if svc.session_affinity == "ClientIP" else 0
    nodeport_addrs = [a for a in node.nodeport_addresses if family_of(a) == family]

    for port in svc.ports:
        proto = PROTOS.get(port.protocol.lower())
        if proto is None:
            if first:
                out.skipped.append(f"Service {sid}: spec.ports[{port.name or port.port}].protocol "
                                   f"{port.protocol} is not supported ({', '.join(p.upper() for p in PROTOS)})")
            continue
        key = ServiceKey(vip, port.port, proto)
        frontends = _frontends(key, port, lb_ips, ext_ips, nodeport_addrs) \
            if lb_ips or ext_ips or port.node_port else ()
        # serviceport.go: ExternallyAccessible, UsesClusterEndpoints, UsesLocalEndpoints.
        # Cluster endpoints serve eTP Local too: pods and the node short-circuit to them.
        externally_accessible = bool(port.node_port or lb_ips or ext_ips)
        uses_cluster = not internal_policy_local or externally_accessible
        uses_local = internal_policy_local or (external_policy_local and externally_accessible)
        eps = merged_endpoints(port.name, port.protocol, slices, family)
        cluster, local, has_any = categorize(eps, uses_cluster, uses_local, node)
        if has_any:   # nftables proxier: hasInternalEndpoints / hasExternalEndpoints false
            out.no_local["internal"] += int(internal_policy_local and not local)
            out.no_local["external"] += int(external_policy_local and not local)
        name = f"{sid}:{port.name or port.port}" + ("/IPv6" if family == IPV6 else "")
        out.services[key] = LbService(
            key=key, cluster=cluster, local=local, frontends=frontends,
            internal_local=internal_policy_local,
            external_local=external_policy_local and externally_accessible,
            has_endpoints=has_any, affinity_s=affinity,
            source_ranges=ranges, name=name)
        out.owners[key] = name
        if proto == socket.IPPROTO_UDP:
            out.udp_serving[key] = frozenset(b for b, ep in eps if ep.serving)

    # NeedsHealthCheck: LoadBalancer with eTP Local, served when the port was allocated.
    # A server per family of the Service (kube-proxy's proxier of each family serves the
    # healthCheckNodePort on its family's addresses), each counting its family's local
    # endpoints: a load balancer probing over IPv6 learns what IPv6 traffic will find.
    if svc.type == "LoadBalancer" and external_policy_local and svc.health_check_node_port and svc.ports:
        out.health_checks[(sid, family)] = (svc.health_check_node_port, _local_ready_ips(slices, node.name, family))


def desired_state(services: dict[str, Service], slices: dict[str, EndpointSlice], node: NodeContext) -> Desired:
    by_service: dict[str, list[EndpointSlice]] = {}
    for s in slices.values():
        by_service.setdefault(s.service_id, []).append(s)
    out = Desired()
    for svc in services.values():
        service_entries(svc, by_service.get(svc.id, []), out, node)
    return out
