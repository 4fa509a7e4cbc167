"""This node, as the service model needs it: its InternalIPs (kube-proxy's "primary" node
addresses, where NodePorts listen by default), its zone (topology hints), and the
addresses of its interfaces that --nodeport-addresses CIDRs select."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError

from .decode import DecodeError, is_ip

ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    ips: tuple[str, ...]       # IPv4 InternalIPs, in the Node's order
    zone: str | None
    pod_cidr: str | None = None  # the IPv4 entry of spec.podCIDRs (detect-local NodeCIDR)


def decode_node(obj: dict) -> NodeInfo:
    md = obj.get("metadata") or {}
    name = md.get("name") or ""
    ips = []
    for i, a in enumerate((obj.get("status") or {}).get("addresses") or ()):
        if a.get("type") != "InternalIP":
            continue
        addr = a.get("address")
        if not is_ip(addr):
            raise DecodeError("Node", name, f"status.addresses[{i}].address", f"{addr!r} is not an IP address")
        if ":" not in addr:  # an IPv6 InternalIP is the IPv6 proxy's business
            ips.append(addr)
    spec = obj.get("spec") or {}
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    pod_cidr = next((c for c in cidrs if isinstance(c, str) and ":" not in c), None)
    return NodeInfo(name=name, ips=tuple(ips), zone=(md.get("labels") or {}).get(ZONE_LABEL), pod_cidr=pod_cidr)


def ipv4_cidrs(items: list[str], flag: str) -> list[str]:
    """The IPv4 CIDRs of a kube-proxy CIDR list (comma-separated and/or repeated; the IPv6
    ones are the IPv6 datapath's business); a clear error naming ``flag`` otherwise."""
    out = []
    for v in (v.strip() for raw in items for v in raw.split(",") if v.strip()):
        try:
            net = ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise KxlbError(f"{flag}: {v!r} is not a CIDR") from None
        if net.version == 4:
            out.append(str(net))
    return out


def parse_nodeport_cidrs(values: list[str]) -> tuple[str, ...]:
    """--nodeport-addresses: "primary" (the default) or CIDRs. Returns the IPv4 CIDRs;
    () for primary."""
    items = [v.strip() for raw in values for v in raw.split(",") if v.strip()]
    if not items or items == ["primary"]:
        return ()
    if "primary" in items:
        raise KxlbError("--nodeport-addresses: 'primary' cannot be combined with CIDRs")
    return tuple(ipv4_cidrs(items, "--nodeport-addresses"))


def nodeport_addresses(cidrs: tuple[str, ...], netns: str | None) -> tuple[str, ...]:
    """The IPv4 addresses of the node's interfaces (in ``netns``) inside ``cidrs``, as
    kube-proxy's --nodeport-addresses selects them."""
    from pyroute2 import IPRoute

    from kxlb.loader.netns import netns as enter

    nets = [ipaddress.IPv4Network(c) for c in cidrs]
    with enter(netns):
        ipr = IPRoute()
    try:
        addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)]
    finally:
        ipr.close()
    return tuple(sorted({a for a in addrs if a and any(ipaddress.IPv4Address(a) in n for n in nets)},
                        key=lambda a: ipaddress.IPv4Address(a).packed))


MIN_SRC_PORTS = 1024  # fewer free ports than this and masqueraded flows would queue up


def masquerade_port_range(netns: str | None) -> tuple[int, int]:
    """Source ports for masqueraded flows that the node's own sockets never pick: the
    part of 1024-65535 outside its ip_local_port_range (the larger side). A range no
    socket uses is what keeps a masqueraded flow's reply from being mistaken for a
    reply to one of the node's connections, and the reverse."""
    from kxlb.loader.netns import netns as enter

    with enter(netns):  # /proc/sys/net shows the opening thread's namespace
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    above, below = (hi + 1, 65535), (1024, lo - 1)
    best = max(above, below, key=lambda r: r[1] - r[0])
    if best[1] - best[0] + 1 < MIN_SRC_PORTS:
        raise ValueError(f"net.ipv4.ip_local_port_range {lo}-{hi} leaves fewer than {MIN_SRC_PORTS} ports "
                         f"for masqueraded flows (kxlb uses the ports outside it): narrow it")
    return best
