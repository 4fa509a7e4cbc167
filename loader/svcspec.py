"""The service model every layer passes on: one service port, its frontends, its two
backend sets and its options (bpf/maps.h, "The service model").

Pure values, no I/O: the controller builds them from Services and EndpointSlices
(controller/model.py), the CLI from its arguments, and loader/services.py writes them
into the maps and reads them back, so "what we want" and "what the maps hold" compare
with ==.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from functools import cached_property
from enum import IntEnum
from typing import NamedTuple

from .errors import KxlbError
from .layout import C, Backend, ServiceKey, family_of


class Kind(IntEnum):
    """How clients reach a service port (struct svc_value.kind)."""

    CLUSTER_IP = C["KIND_CLUSTER_IP"]
    NODE_PORT = C["KIND_NODE_PORT"]
    EXTERNAL_IP = C["KIND_EXTERNAL_IP"]
    LOAD_BALANCER = C["KIND_LOAD_BALANCER"]

    @property
    def external(self) -> bool:
        """Subject to externalTrafficPolicy (everything but the cluster IP)."""
        return self is not Kind.CLUSTER_IP

    @property
    def label(self) -> str:
        return {Kind.CLUSTER_IP: "ClusterIP", Kind.NODE_PORT: "NodePort", Kind.EXTERNAL_IP: "ExternalIP",
                Kind.LOAD_BALANCER: "LoadBalancer"}[self]


class Frontend(NamedTuple):
    key: ServiceKey
    kind: Kind

    def __str__(self) -> str:
        return f"{self.key} ({self.kind.label})"


@dataclass(frozen=True)
class LbService:
    """One service port as the datapath serves it.

    ``key`` is its cluster IP frontend: the identity under which the maps hold it (and
    under which a restarted controller adopts it). ``frontends`` are the other ways in
    (NodePort on each node address, externalIPs, load-balancer IPs). ``cluster`` is the
    cluster-wide backend set, ``local`` this node's: each already filtered by kube-proxy's
    rules (ready, else serving+terminating; topology for the cluster set), and each
    empty when the service's policies never use it.
    """

    key: ServiceKey
    cluster: tuple[Backend, ...] = ()
    local: tuple[Backend, ...] = ()
    frontends: tuple[Frontend, ...] = ()
    internal_local: bool = False           # internalTrafficPolicy: Local
    external_local: bool = False           # externalTrafficPolicy: Local
    has_endpoints: bool = False            # some usable endpoint exists anywhere
    affinity_s: int = 0                    # sessionAffinity ClientIP timeout; 0: none
    source_ranges: tuple[str, ...] = ()    # loadBalancerSourceRanges (+ LB IPs/32 for the node)
    name: str = field(default="", compare=False)  # "ns/name:port", for messages only

    @classmethod
    def simple(cls, key: ServiceKey, backends, name: str = "") -> "LbService":
        """A cluster IP with one backend set: what `kxlb service add` makes."""
        backends = tuple(backends)
        return cls(key=key, cluster=backends, has_endpoints=bool(backends), name=name)

    @cached_property  # read several times per write; the record is immutable
    def all_frontends(self) -> tuple[Frontend, ...]:
        return (Frontend(self.key, Kind.CLUSTER_IP),) + self.frontends

    @property
    def label(self) -> str:
        return self.name or str(self.key)

    def flags_for(self, kind: Kind) -> int:
        """struct svc_value.flags of this service's frontend of ``kind``."""
        f = C["SVC_F_HAS_ENDPOINTS"] if self.has_endpoints else 0
        if self.internal_local if kind is Kind.CLUSTER_IP else self.external_local:
            f |= C["SVC_F_LOCAL"]
        if self.affinity_s:
            f |= C["SVC_F_AFFINITY"]
        if self.source_ranges and kind is Kind.LOAD_BALANCER:
            f |= C["SVC_F_SRC_RANGES"]
        return f

    def canonical(self) -> "LbService":
        """The form the maps can hold and give back: sorted frontends and ranges; options
        that no frontend carries dropped (an eTP without an external frontend, source
        ranges without a load-balancer IP)."""
        if not self.frontends and not self.source_ranges and not self.external_local:
            return self  # a cluster IP alone (most service ports): already canonical
        kinds = {fe.kind for fe in self.frontends}
        return replace(
            self,
            frontends=tuple(sorted(set(self.frontends), key=lambda f: (f.kind, f.key))),
            external_local=self.external_local and bool(kinds),
            source_ranges=self._ranges_of_family() if Kind.LOAD_BALANCER in kinds else (),
        )

    def _ranges_of_family(self) -> tuple[str, ...]:
        """The source ranges of the service's family, normalised and sorted: a
        dual-stack Service lists both families' ranges in one field, and each family's
        service port applies its own (kube-proxy filters them the same way)."""
        nets = {ipaddress.ip_network(c, strict=False) for c in self.source_ranges}
        version = self.key.family.version
        return tuple(str(n) for n in sorted(n for n in nets if n.version == version))

    def validate(self, max_backends: int) -> "LbService":
        """Raise KxlbError naming the service and field for what the maps cannot hold."""
        for what, bs in (("backends", self.cluster), ("local backends", self.local)):
            if len(set(bs)) != len(bs):
                dup = next(b for b in bs if bs.count(b) > 1)
                raise KxlbError(f"service {self.label}: duplicate {what[:-1]} {dup}")
            if len(bs) > max_backends:
                raise KxlbError(f"service {self.label}: {len(bs)} {what}, at most {max_backends} per set")
        if self.frontends:
            keys = [fe.key for fe in self.all_frontends]
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise KxlbError(f"service {self.label}: frontend {dup} listed twice")
            if any(fe.key.proto != self.key.proto for fe in self.frontends):
                raise KxlbError(f"service {self.label}: every frontend must use protocol of {self.key}")
        if not 0 <= self.affinity_s <= 86400:
            raise KxlbError(f"service {self.label}: sessionAffinity timeout {self.affinity_s} s is out of "
                            "range 1-86400")
        for cidr in self.source_ranges:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise KxlbError(f"service {self.label}: source range {cidr!r} is not an IPv4 or IPv6 CIDR") from None
        family = self.key.family
        mixed = [str(b) for b in self.cluster + self.local if family_of(b.addr) is not family]
        mixed += [str(fe) for fe in self.frontends if family_of(fe.key.vip) is not family]
        if mixed:
            raise KxlbError(f"service {self.label}: {', '.join(mixed)} not {family.name} like the service "
                            "(a service port has one family; a dual-stack Service is one per family)")
        return self
