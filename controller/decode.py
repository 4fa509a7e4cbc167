"""Raw API JSON (dicts, as listed and watched without the client's models) -> model.

Every field is checked; a bad one raises DecodeError naming the object and the field,
so the controller can skip that object, say why, and keep going.
"""
from __future__ import annotations

import socket

from .model import Endpoint, EndpointSlice, Service, ServicePort, SlicePort

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def is_ip(text) -> bool:
    """IPv4 or IPv6, as the API formats them (inet_pton: C-fast, unlike ipaddress)."""
    try:
        socket.inet_pton(socket.AF_INET, text)
        return True
    except (OSError, TypeError):
        pass
    try:
        socket.inet_pton(socket.AF_INET6, text)
        return True
    except (OSError, TypeError):
        return False


class DecodeError(ValueError):
    def __init__(self, kind: str, obj_id: str, field: str, problem: str):
        super().__init__(f"{kind} {obj_id}: {field}: {problem}")
        self.kind, self.obj_id, self.field = kind, obj_id, field


def _id(obj: dict) -> str:
    md = obj.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


def _port(value, kind: str, oid: str, field: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise DecodeError(kind, oid, field, f"port {value!r} is not in 1-65535")
    return value


def decode_service(obj: dict) -> Service:
    oid = _id(obj)
    spec = obj.get("spec") or {}
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    for i, ip in enumerate(ips):
        if ip == "None" and i == 0:
            continue
        if not is_ip(ip):
            raise DecodeError("Service", oid, f"spec.clusterIPs[{i}]", f"{ip!r} is not an IP address")
    ports = []
    for i, p in enumerate(spec.get("ports") or []):
        ports.append(ServicePort(name=p.get("name") or "",
                                 port=_port(p.get("port"), "Service", oid, f"spec.ports[{i}].port"),
                                 protocol=p.get("protocol") or "TCP"))
    return Service(namespace=obj["metadata"].get("namespace", ""), name=obj["metadata"]["name"],
                   type=spec.get("type") or "ClusterIP", cluster_ips=tuple(ips), ports=tuple(ports))


def decode_slice(obj: dict) -> EndpointSlice:
    oid = _id(obj)
    md = obj.get("metadata") or {}
    service = (md.get("labels") or {}).get(SERVICE_NAME_LABEL)
    if not service:
        raise DecodeError("EndpointSlice", oid, f"metadata.labels[{SERVICE_NAME_LABEL}]", "missing")
    atype = obj.get("addressType") or "IPv4"
    endpoints = []
    append = endpoints.append  # the hot loop of a full sync: ~100k endpoints for 10k services
    check_ip = atype in ("IPv4", "IPv6")
    for i, ep in enumerate(obj.get("endpoints") or ()):
        addrs = ep.get("addresses")
        if not addrs:
            continue
        addr = addrs[0]
        if check_ip and not is_ip(addr):
            raise DecodeError("EndpointSlice", oid, f"endpoints[{i}].addresses[0]",
                              f"{addr!r} is not an IP address")
        cond = ep.get("conditions")
        if cond:  # absent ready/serving mean true, absent terminating false (as kube-proxy)
            append(Endpoint(addr, cond.get("ready") is not False, cond.get("serving") is not False,
                            cond.get("terminating") is True, ep.get("nodeName")))
        else:
            append(Endpoint(addr, True, True, False, ep.get("nodeName")))
    ports = []
    for i, p in enumerate(obj.get("ports") or []):
        ports.append(SlicePort(name=p.get("name") or "",
                               port=_port(p.get("port"), "EndpointSlice", oid, f"ports[{i}].port", optional=True),
                               protocol=p.get("protocol") or "TCP"))
    return EndpointSlice(namespace=md.get("namespace", ""), name=md["name"], service=service,
                         address_type=atype, endpoints=tuple(endpoints), ports=tuple(ports))
