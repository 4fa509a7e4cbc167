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

from kxlb.loader.layout import C, Backend, CtKey, ServiceKey, ip_to_raw, port_to_raw
from kxlb.loader.maps import Maps
from kxlb.loader.svcspec import Kind, LbService

UDP = socket.IPPROTO_UDP
_Raw = tuple[int, int]  # (address, port) as the map stores them


def serving_by_frontend(ports: Iterable[tuple[LbService, frozenset[Backend]]]) -> dict[_Raw, frozenset[_Raw]]:
    """(frontend address, port) -> the serving endpoints of its UDP service port."""
    out: dict[_Raw, frozenset[_Raw]] = {}
    for spec, serving in ports:
        if spec.key.proto != UDP:
            continue
        raw = frozenset((ip_to_raw(b.addr), port_to_raw(b.port)) for b in serving)
        for fe in spec.all_frontends:
            if fe.kind is Kind.NODE_PORT and not raw:
                continue  # kube-proxy: NodePorts only judged while the port has serving endpoints
            out[(ip_to_raw(fe.key.vip), port_to_raw(fe.key.port))] = raw
    return out


def clean_stale_udp_flows(maps: Maps, serving: dict[_Raw, frozenset[_Raw]]) -> int:
    """Delete both entries of every stale UDP flow; returns the entries deleted."""
    if not serving:
        return 0
    fwd, rev_dir, snat_flag = C["CT_DIR_FWD"], C["CT_DIR_REV"], C["CT_F_SNAT"]
    deleted = 0
    for k, e in maps.conntrack.items():
        if k.proto != UDP or k.dir != fwd:
            continue
        allowed = serving.get((k.daddr, k.dport))
        if allowed is None or (e.nat_addr, e.nat_port) in allowed:
            continue
        snat = e.flags & snat_flag
        rev = CtKey(saddr=e.nat_addr, daddr=e.snat_addr if snat else k.saddr, sport=e.nat_port,
                    dport=e.snat_port if snat else k.sport, proto=UDP, dir=rev_dir)
        deleted += maps.conntrack.delete(k) + maps.conntrack.delete(rev)
    return deleted


__all__ = ["serving_by_frontend", "clean_stale_udp_flows", "ServiceKey"]
