"""Desired datapath state from Services and EndpointSlices: pure logic, no I/O.

The rules are kube-proxy's (pkg/proxy: servicechangetracker, endpointslicecache,
topology): see ../shared/reference/service-proxy-semantics.md and docs/controller.md.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import NamedTuple

from kxlb.loader.layout import PROTOS, Backend, ServiceKey

IPV4 = "IPv4"


# Small value types are NamedTuples: a 10k-service sync makes ~100k of them, and tuple
# construction is several times cheaper than a frozen dataclass's.
class ServicePort(NamedTuple):
    name: str        # "" for a single unnamed port
    port: int
    protocol: str    # "TCP", "UDP", "SCTP"


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    type: str = "ClusterIP"
    cluster_ips: tuple[str, ...] = ()
    ports: tuple[ServicePort, ...] = ()

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


class SlicePort(NamedTuple):
    name: str
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


@dataclass
class Desired:
    """What the maps should hold, and why some of it is missing."""

    services: dict[ServiceKey, tuple[Backend, ...]] = field(default_factory=dict)
    owners: dict[ServiceKey, str] = field(default_factory=dict)   # key -> "ns/name:port"
    skipped: list[str] = field(default_factory=list)              # human-readable reasons


def _is_ipv4(ip: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, ip)
        return True
    except OSError:
        return False


def endpoints_for_port(port: ServicePort, slices: list[EndpointSlice]) -> tuple[Backend, ...]:
    """The backends that take new connections on one service port.

    Slice ports match the service port by name (a named targetPort resolves per slice);
    the same address in two slices: the non-terminating one wins. Ready endpoints are
    used; if none is ready, those serving and terminating (KEP-1669)."""
    seen: dict[Backend, Endpoint] = {}
    for s in slices:
        if s.address_type != IPV4:
            continue
        for sp in s.ports:
            if sp.name != port.name or sp.protocol != port.protocol or not sp.port:
                continue
            for ep in s.endpoints:
                b = Backend(ep.address, sp.port)
                prev = seen.get(b)
                if prev is None or (prev.terminating and not ep.terminating):
                    seen[b] = ep
    ready = [b for b, ep in seen.items() if ep.ready]
    if not ready:
        ready = [b for b, ep in seen.items() if ep.serving and ep.terminating]
    # Sorted: every node and every restart lays the slots out the same way, so the
    # flow hash picks the same backend everywhere.
    return tuple(sorted(ready, key=lambda b: (socket.inet_aton(b.addr), b.port)))


def service_entries(svc: Service, slices: list[EndpointSlice], out: Desired) -> None:
    """Add one Service's map entries (every IPv4 cluster IP x every port) to ``out``."""
    if svc.type == "ExternalName" or svc.headless:
        return
    ips = [ip for ip in svc.cluster_ips if _is_ipv4(ip)]
    if not ips:
        return  # IPv6-only: the IPv6 proxy's business
    for port in svc.ports:
        proto = PROTOS.get(port.protocol.lower())
        if proto is None:
            out.skipped.append(f"Service {svc.id}: spec.ports[{port.name or port.port}].protocol "
                               f"{port.protocol} is not supported (TCP, UDP)")
            continue
        backends = endpoints_for_port(port, slices)
        for ip in ips:
            key = ServiceKey(ip, port.port, proto)
            out.services[key] = backends
            out.owners[key] = f"{svc.id}:{port.name or port.port}"


def desired_state(services: dict[str, Service], slices: dict[str, EndpointSlice]) -> Desired:
    by_service: dict[str, list[EndpointSlice]] = {}
    for s in slices.values():
        by_service.setdefault(s.service_id, []).append(s)
    out = Desired()
    for svc in services.values():
        service_entries(svc, by_service.get(svc.id, []), out)
    return out
