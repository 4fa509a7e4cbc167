"""This node, as the service model needs it: its node IPs (kube-proxy's GetNodeHostIPs:
the first InternalIP, else ExternalIP, of each family), its zone (topology hints), and
the addresses of its interfaces that --nodeport-addresses selects."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError

from .decode import DecodeError, canonical_ip6, is_ip, leave_out

ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    ips: tuple[str, ...]       # node IPs: the primary one, then the other family's (GetNodeHostIPs)
    zone: str | None
    pod_cidrs: tuple[str, ...] = ()  # spec.podCIDRs, one per family (detect-local NodeCIDR)
    external: frozenset[str] = frozenset()   # node IPs that are ExternalIPs (no InternalIP of the family)

    def first_ip(self, version: int) -> str | None:
        """The node IP of a family (kube-proxy's node IP of that family's proxier)."""
        return next((a for a in self.ips if (":" in a) == (version == 6)), None)


def _addresses(obj: dict, name: str, kind: str, skipped: list[DecodeError] | None) -> list[str]:
    out = []
    for i, a in enumerate((obj.get("status") or {}).get("addresses") or ()):
        if a.get("type") != kind:
            continue
        addr = a.get("address")
        addr = canonical_ip6(addr) if isinstance(addr, str) and ":" in addr else addr
        if not is_ip(addr):
            # GetNodeHostIPs skips what it cannot parse
            leave_out(DecodeError("Node", name, f"status.addresses[{i}].address",
                                  f"{a.get('address')!r} is not an IP address"), skipped)
            continue
        out.append(addr)
    return out


def decode_node(obj: dict, skipped: list[DecodeError] | None = None) -> NodeInfo:
    """``skipped``: an address that is not an IP is left out and reported there (as
    kube-proxy's GetNodeHostIPs skips it), else it is the Node's DecodeError."""
    md = obj.get("metadata") or {}
    name = md.get("name") or ""
    # GetNodeHostIPs: InternalIPs before ExternalIPs; the first is the primary node IP,
    # then the first of the other family. A node with only ExternalIPs still has node IPs
    # (NodePorts under "primary", the masquerade address if the node holds it).
    internal = _addresses(obj, name, "InternalIP", skipped)
    every = internal + _addresses(obj, name, "ExternalIP", skipped)
    ips = every[:1] + [a for a in every[1:] if (":" in a) != (":" in every[0])][:1]
    spec = obj.get("spec") or {}
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    pod_cidrs = []
    for version in (4, 6):
        c = next((c for c in cidrs if isinstance(c, str) and (":" in c) == (version == 6)), None)
        if c:
            pod_cidrs.append(c)
    return NodeInfo(name=name, ips=tuple(ips), zone=(md.get("labels") or {}).get(ZONE_LABEL),
                    pod_cidrs=tuple(pod_cidrs), external=frozenset(a for a in ips if a not in internal))


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


PRIMARY, LOCALHOST, ALL = "primary", "localhost", "all"   # kube-proxy's nodePortAddresses keywords


def parse_nodeport_addresses(values: list[str]) -> tuple[str, ...]:
    """--nodeport-addresses / nodePortAddresses as kube-proxy takes them: the keywords
    primary, localhost and all, and CIDRs of either family, mixed (comma-separated and/or
    repeated). Normalised, in order, without repeats; () when not set."""
    out: list[str] = []
    for v in (v.strip() for raw in values for v in raw.split(",") if v.strip()):
        out.extend([v] if v in (PRIMARY, LOCALHOST, ALL) else parse_cidrs([v], "--nodeport-addresses"))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class NodePortSelection:
    """What one family's NodePorts listen on (kube-proxy's NodePortAddresses of a family)."""

    version: int
    nets: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    match_all: bool            # a zero CIDR: every address of the node (of this family)
    explicit_loopback: bool    # a CIDR aimed at loopback: localhost NodePorts asked for

    def picks(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if addr.version != self.version or not any(addr in n for n in self.nets):
            return False
        # Loopback NodePorts only when a CIDR targets loopback ("localhost", 127.0.0.0/8):
        # nftables-mode kube-proxy never serves them otherwise (kxlb: the node's own
        # processes reach them through the socket hooks).
        return self.explicit_loopback or not addr.is_loopback


def nodeport_selection(items: tuple[str, ...], node_ips: tuple[str, ...]) -> dict[int, NodePortSelection]:
    """kube-proxy's expandNodePortAddressKeywords then NewNodePortAddresses, per family:
    primary is each family's node IP (a /32 or /128), localhost the loopback CIDRs, all
    the zero CIDRs; a family with no CIDR left gets its zero CIDR (every address), as
    kube-proxy does (a dual-stack node given only IPv4 CIDRs serves IPv6 NodePorts on
    every IPv6 address). () is "primary"."""
    nets = []
    for item in items or (PRIMARY,):
        if item == PRIMARY:
            nets += [ipaddress.ip_network(ip) for ip in node_ips if not ipaddress.ip_address(ip).is_loopback]
        elif item == LOCALHOST:
            nets += [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
        elif item == ALL:
            nets += [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
        else:
            nets.append(ipaddress.ip_network(item))
    out = {}
    for version in (4, 6):
        mine = [n for n in nets if n.version == version] or [ipaddress.ip_network("0.0.0.0/0" if version == 4
                                                                                  else "::/0")]
        out[version] = NodePortSelection(
            version, tuple(mine), match_all=any(n.prefixlen == 0 for n in mine),
            explicit_loopback=any(n.network_address.is_loopback for n in mine))
    return out


def select_nodeport_addresses(selection: dict[int, NodePortSelection], local: list[str]) -> tuple[str, ...]:
    """The node's interface addresses (``local``) where NodePorts listen, both families,
    IPv4 first, canonical and sorted."""
    found = {ipaddress.ip_address(a) for a in local if a}
    picked = sorted((a for a in found if selection[a.version].picks(a)), key=lambda a: (a.version, a.packed))
    return tuple(str(a) if a.version == 4 else canonical_ip6(str(a)) for a in picked)


def interface_addresses(netns: str | None) -> list[str]:
    """Every address of the node's interfaces (in ``netns``)."""
    from pyroute2 import IPRoute

    from kxlb.loader.netns import netns as enter

    with enter(netns):
        ipr = IPRoute()
    try:
        return [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr()]
    finally:
        ipr.close()


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