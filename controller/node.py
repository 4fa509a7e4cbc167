"""This node, as the service model needs it: its InternalIPs (kube-proxy's "primary" node
addresses, where NodePorts listen by default), its zone (topology hints), and the
addresses of its interfaces that --nodeport-addresses CIDRs select."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError

from .decode import DecodeError, canonical_ip6, is_ip

ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    ips: tuple[str, ...]       # InternalIPs of both families, in the Node's order
    zone: str | None
    pod_cidrs: tuple[str, ...] = ()  # spec.podCIDRs, one per family (detect-local NodeCIDR)

    def first_ip(self, version: int) -> str | None:
        """The primary InternalIP of a family (kube-proxy's node IP of that proxier)."""
        return next((a for a in self.ips if (":" in a) == (version == 6)), None)


def decode_node(obj: dict) -> NodeInfo:
    md = obj.get("metadata") or {}
    name = md.get("name") or ""
    ips = []
    for i, a in enumerate((obj.get("status") or {}).get("addresses") or ()):
        if a.get("type") != "InternalIP":
            continue
        addr = a.get("address")
        addr = canonical_ip6(addr) if isinstance(addr, str) and ":" in addr else addr
        if not is_ip(addr):
            raise DecodeError("Node", name, f"status.addresses[{i}].address", f"{a.get('address')!r} "
                              "is not an IP address")
        ips.append(addr)
    spec = obj.get("spec") or {}
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    pod_cidrs = []
    for version in (4, 6):
        c = next((c for c in cidrs if isinstance(c, str) and (":" in c) == (version == 6)), None)
        if c:
            pod_cidrs.append(c)
    return NodeInfo(name=name, ips=tuple(ips), zone=(md.get("labels") or {}).get(ZONE_LABEL),
                    pod_cidrs=tuple(pod_cidrs))


def parse_cidrs(items: list[str], flag: str) -> list[str]:
    """The CIDRs of a kube-proxy CIDR list (comma-separated and/or repeated, either
    family), normalised; a clear error naming ``flag`` otherwise."""
    out = []
    for v in (v.strip() for raw in items for v in raw.split(",") if v.strip()):
        try:
            net = ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise KxlbError(f"{flag}: {v!r} is not a CIDR") from None
        out.append(str(net))
    return out


def one_cidr_per_family(text: str | None, flag: str) -> tuple[str, ...]:
    """A CIDR list as kube-proxy's --cluster-cidr takes it ("v4", "v6" or "v4,v6"):
    at most one per family."""
    cidrs = parse_cidrs([text], flag) if text else []
    for version in (4, 6):
        mine = [c for c in cidrs if ipaddress.ip_network(c).version == version]
        if len(mine) > 1:
            raise KxlbError(f"{flag} {text!r}: more than one IPv{version} CIDR")
    return tuple(cidrs)


def parse_nodeport_cidrs(values: list[str]) -> tuple[str, ...]:
    """--nodeport-addresses: "primary" (the default) or CIDRs of either family. Returns
    the CIDRs; () for primary."""
    items = [v.strip() for raw in values for v in raw.split(",") if v.strip()]
    if not items or items == ["primary"]:
        return ()
    if "primary" in items:
        raise KxlbError("--nodeport-addresses: 'primary' cannot be combined with CIDRs")
    return tuple(parse_cidrs(items, "--nodeport-addresses"))


def nodeport_addresses(cidrs: tuple[str, ...], netns: str | None) -> tuple[str, ...]:
    """The addresses (both families) of the node's interfaces (in ``netns``) inside
    ``cidrs``, as kube-proxy's --nodeport-addresses selects them."""
    from pyroute2 import IPRoute

    from kxlb.loader.netns import netns as enter

    nets = [ipaddress.ip_network(c) for c in cidrs]
    with enter(netns):
        ipr = IPRoute()
    try:
        addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr()]
    finally:
        ipr.close()
    found = {ipaddress.ip_address(a) for a in addrs if a}
    return tuple(str(a) if a.version == 4 else canonical_ip6(str(a))
                 for a in sorted((a for a in found if any(a.version == n.version and a in n for n in nets)),
                                 key=lambda a: (a.version, a.packed)))


MIN_SRC_PORTS = 1024  # fewer free ports than this and masqueraded flows would queue up
NODE_PORT_RANGE = (30000, 32767)  # kube-apiserver's default --service-node-port-range


def parse_port_range(text: str, flag: str) -> tuple[int, int]:
    """LO-HI -> (lo, hi), or one clear error naming the flag."""
    lo, dash, hi = str(text).partition("-")
    if not dash or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi) <= 65535:
        raise KxlbError(f"{flag} {text!r}: expected LO-HI, ports 1-65535")
    return int(lo), int(hi)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def masquerade_port_range(netns: str | None, node_ports: tuple[int, int] = NODE_PORT_RANGE,
                          explicit: tuple[int, int] | None = None) -> tuple[int, int]:
    """Source ports for masqueraded (and remapped) flows: a range no socket of the node
    picks (outside its ip_local_port_range) and no NodePort uses (outside the cluster's
    NodePort range: the datapath looks a reply to a masquerade port up before the
    frontends, but a NodePort in the range would be shadowed for the backends of its
    flows). Without ``explicit``, the largest such part of 1024-65535; an explicit range
    (--masquerade-ports) overlapping either is refused."""
    from kxlb.loader.netns import netns as enter

    with enter(netns):  # /proc/sys/net shows the opening thread's namespace
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = tuple(int(x) for x in f.read().split())
    if explicit is not None:
        for other, what in ((ephemeral, "net.ipv4.ip_local_port_range"), (node_ports, "the NodePort range")):
            if _overlap(explicit, other):
                raise KxlbError(f"--masquerade-ports {explicit[0]}-{explicit[1]} overlaps {what} "
                                f"{other[0]}-{other[1]}: a reply to a masqueraded flow would be taken for "
                                f"{'a new connection to the node' if other is ephemeral else 'a NodePort'}")
        best = explicit
    else:
        edges = sorted([ephemeral, node_ports])
        cuts, start = [], 1024
        for lo, hi in edges:
            if lo > start:
                cuts.append((start, lo - 1))
            start = max(start, hi + 1)
        if start <= 65535:
            cuts.append((start, 65535))
        best = max(cuts, key=lambda r: r[1] - r[0], default=(0, -1))
    if best[1] - best[0] + 1 < MIN_SRC_PORTS:
        raise KxlbError(f"masquerade ports {best[0]}-{best[1]}: fewer than {MIN_SRC_PORTS} ports outside "
                        f"net.ipv4.ip_local_port_range {ephemeral[0]}-{ephemeral[1]} and the NodePort range "
                        f"{node_ports[0]}-{node_ports[1]}")
    return best