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
