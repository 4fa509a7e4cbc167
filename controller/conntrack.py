"""UDP conntrack cleanup with kube-proxy's rules (pkg/proxy/conntrack/cleanup.go), run
after every sync over the datapath's conntrack map.

A UDP flow has no end the kernel can see, so a client (a DNS resolver on one socket)
would keep sending to an endpoint that is gone. kube-proxy deletes, after every sync,
each UDP flow whose destination is a service IP (cluster IP, load-balancer IP,
externalIP) and port and whose endpoint is not a *serving* endpoint of that service port
(terminating but still serving endpoints keep their flows: graceful drain), and each flow
to a NodePort whose service port has serving endpoints, when its endpoint is not one of
them. Flows of deleted services are left alone, as kube-proxy leaves them.

One difference: kube-proxy matches NodePort flows by port number alone (so a flow to
another service IP with the same port number is judged against the NodePort's service);
here a NodePort flow is one addressed to a NodePort frontend of this node.
"""
from __future__ import annotations

import socket
from typing import Iterable

from kxlb.loader import conntrack
from kxlb.loader.layout import Backend, Family, ServiceKey, family_of, port_to_raw
from kxlb.loader.maps import Maps
from kxlb.loader.svcspec import Kind, LbService

UDP = socket.IPPROTO_UDP
_Raw = tuple[int | bytes, int]  # (address, port) as the map stores them (an IPv6 address's bytes)


def _raw(addr: str, port: int) -> _Raw:
    raw = family_of(addr).addr_c(addr)
    return (raw if isinstance(raw, int) else bytes(raw)), port_to_raw(port)


def serving_by_frontend(ports: Iterable[tuple[LbService, frozenset[Backend]]]) -> dict[_Raw, frozenset[_Raw]]:
    """(frontend address, port) -> the serving endpoints of its UDP service port."""
    out: dict[_Raw, frozenset[_Raw]] = {}
    for spec, serving in ports:
        if spec.key.proto != UDP:
            continue
        raw = frozenset(_raw(b.addr, b.port) for b in serving)
        for fe in spec.all_frontends:
            if fe.kind is Kind.NODE_PORT and not raw:
                continue  # kube-proxy: NodePorts only judged while the port has serving endpoints
            out[_raw(fe.key.vip, fe.key.port)] = raw
    return out


def clean_stale_udp_flows(maps: Maps, serving: dict[_Raw, frozenset[_Raw]], fam: Family) -> int:
    """Delete every stale UDP flow of one family (its way, and its masquerade port);
    returns how many."""
    if not serving:
        return 0
    deleted = 0
    for flow in conntrack.flows(maps, (fam,)):
        if flow.proto != UDP:
            continue
        allowed = serving.get(_raw(flow.front.addr, flow.front.port))
        if allowed is None or _raw(flow.backend.addr, flow.backend.port) in allowed:
            continue
        deleted += conntrack.delete_flow(maps, flow)
    return deleted


__all__ = ["serving_by_frontend", "clean_stale_udp_flows", "ServiceKey"]
