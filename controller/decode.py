"""Raw API JSON (dicts, as listed and watched without the client's models) -> model.

Every field is checked; a bad one raises DecodeError naming the object and the field,
so the controller can skip that object, say why, and keep going. Except where kube-proxy
itself just skips an entry (an externalIP or ingress IP it cannot parse): one bad entry
must not take the whole Service down.
"""
from __future__ import annotations

import socket
from sys import intern

from .model import Endpoint, EndpointSlice, Service, ServicePort, SlicePort, ipv4_sloppy

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def canonical_ip6(text) -> str | None:
    """An IPv6 address in the one text form the maps give back (inet_ntop's), or None.
    The API stores IPv6 addresses as written; two spellings of one address must be one
    backend, and what the controller wants must compare equal to what it reads back."""
    try:
        return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, text))
    except (OSError, TypeError, ValueError):
        return None


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


def leave_out(err: DecodeError, skipped: list[DecodeError] | None) -> None:
    """An entry kube-proxy would ignore: reported in ``skipped`` by a caller that keeps
    the rest of the object, else the whole object's error."""
    if skipped is None:
        raise err
    skipped.append(err)


def _id(obj: dict) -> str:
    md = obj.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


def _shared(value):
    """One string object for a value many objects repeat (namespace, protocol, port name,
    policy, node): json.loads makes a new one per occurrence, which the decoded caches
    would otherwise keep 30k times over. Anything else unchanged (validated elsewhere)."""
    return intern(value) if type(value) is str else value


def _port(value, kind: str, oid: str, field: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise DecodeError(kind, oid, field, f"port {value!r} is not in 1-65535")
    return value


def _int(value, kind: str, oid: str, field: str, lo: int, hi: int, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise DecodeError(kind, oid, field, f"{value!r} is not an integer in {lo}-{hi}")
    return value


def _typed(value, typ: type, oid: str, field: str, default):
    """``value`` if of type ``typ``, ``default`` if absent; else the object is malformed."""
    if value is None:
        return default
    if not isinstance(value, typ):
        raise DecodeError("Service", oid, field, f"{value!r} is not a {typ.__name__}")
    return value


def _ip(text) -> str | None:
    """An IP address as kube-proxy's ParseIPSloppy accepts it, else None. IPv4 comes out
    dotted-quad (leading zeros and the IPv4-mapped IPv6 form are IPv4 to Go)."""
    try:
        socket.inet_pton(socket.AF_INET, text)
        return text
    except (OSError, TypeError):
        pass
    if not isinstance(text, str):
        return None
    return ipv4_sloppy(text) or canonical_ip6(text)


def _ingress(lb, oid: str) -> tuple[tuple[str, str | None], ...]:
    """status.loadBalancer.ingress: (ip, ipMode) of the entries with an IP. Hostname-only
    entries are for the load balancer's clients, not for the proxy; an IP kube-proxy
    cannot parse is skipped, as it does."""
    out = []
    field = "status.loadBalancer.ingress"
    for i, ing in enumerate(_typed(_typed(lb, dict, oid, "status.loadBalancer", {}).get("ingress"), list, oid,
                                   field, ())):
        ip = _ip(ing.get("ip")) if isinstance(ing, dict) else None
        if ip:
            out.append((ip, _typed(ing.get("ipMode"), str, oid, f"{field}[{i}].ipMode", None)))
    return tuple(out)


def _affinity_timeout(spec: dict, oid: str) -> int:
    cfg = _typed(spec.get("sessionAffinityConfig"), dict, oid, "spec.sessionAffinityConfig", {})
    client = _typed(cfg.get("clientIP"), dict, oid, "spec.sessionAffinityConfig.clientIP", {})
    return _int(client.get("timeoutSeconds"), "Service", oid,
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds", 1, 86400, 10800)


_STRINGS = ("type", "externalTrafficPolicy", "internalTrafficPolicy", "sessionAffinity", "trafficDistribution")


def decode_service(obj: dict) -> Service:
    oid = _id(obj)
    spec = obj.get("spec") or {}
    ips = list(spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else []))
    for i, ip in enumerate(ips):
        if ip == "None" and i == 0:
            continue
        ips[i] = _ip(ip)
        if ips[i] is None:
            raise DecodeError("Service", oid, f"spec.clusterIPs[{i}]", f"{ip!r} is not an IP address")
    ports = []
    for i, p in enumerate(spec.get("ports") or []):
        np = p.get("nodePort")   # absent: none allocated (ClusterIP, allocateLoadBalancerNodePorts: false)
        ports.append(ServicePort(_shared(p.get("name") or ""),
                                 _port(p.get("port"), "Service", oid, f"spec.ports[{i}].port"),
                                 _shared(p.get("protocol") or "TCP"),
                                 _int(np, "Service", oid, f"spec.ports[{i}].nodePort", 0, 65535, 0) if np else 0))
    # The policies etc. are only compared with their values: a string of any other
    # value means the default, as in kube-proxy; a non-string is a malformed object.
    get = spec.get
    typ, etp, itp = _shared(get("type") or "ClusterIP"), _shared(get("externalTrafficPolicy") or "Cluster"), \
        _shared(get("internalTrafficPolicy") or "Cluster")
    aff, td = _shared(get("sessionAffinity") or "None"), _shared(get("trafficDistribution") or None)
    if not (type(typ) is type(etp) is type(itp) is type(aff) is str) or not (td is None or type(td) is str):
        k, v = next((k, spec[k]) for k in _STRINGS if spec.get(k) and type(spec[k]) is not str)
        raise DecodeError("Service", oid, f"spec.{k}", f"{v!r} is not a string")
    # The optional lists, decoded only when present (the hot loop of a 10k-service sync)
    ext = spec.get("externalIPs")
    if ext:   # kube-proxy skips entries it cannot parse: one must not take the Service down
        ext = tuple(ip for ip in map(_ip, _typed(ext, list, oid, "spec.externalIPs", ())) if ip)
    ranges = spec.get("loadBalancerSourceRanges")
    if ranges:   # kept as written: the model trims, parses and reports them as kube-proxy
        ranges = tuple(_typed(r, str, oid, f"spec.loadBalancerSourceRanges[{i}]", "")
                       for i, r in enumerate(_typed(ranges, list, oid, "spec.loadBalancerSourceRanges", ())))
    status = obj.get("status")
    lb = status.get("loadBalancer") if status else None
    hc = spec.get("healthCheckNodePort")
    return Service(
        namespace=_shared(obj["metadata"].get("namespace", "")), name=obj["metadata"]["name"],
        type=typ, cluster_ips=tuple(ips), ports=tuple(ports),
        external_ips=ext or (), lb_ingress=_ingress(lb, oid) if lb else (), lb_source_ranges=ranges or (),
        external_traffic_policy=etp, internal_traffic_policy=itp, session_affinity=aff,
        # kube-proxy reads the timeout only for ClientIP; 10800 s is the API's default
        affinity_timeout=_affinity_timeout(spec, oid) if aff == "ClientIP" else 10800,
        traffic_distribution=td,
        health_check_node_port=_int(hc, "Service", oid, "spec.healthCheckNodePort", 0, 65535, 0) if hc else 0)


def _hint_names(hints: dict, key: str, oid: str, i: int) -> tuple[str, ...]:
    """endpoints[i].hints.<key>[].name (forZones, forNodes)."""
    try:
        return tuple(intern(h.get("name") or "") for h in hints.get(key) or ())
    except (AttributeError, TypeError):
        raise DecodeError("EndpointSlice", oid, f"endpoints[{i}].hints.{key}",
                          "not a list of {name: ...} objects") from None


def decode_slice(obj: dict, skipped: list[DecodeError] | None = None) -> EndpointSlice:
    """``skipped``: a bad endpoint address or port is left out and reported there (as
    kube-proxy ignores such an entry, one bad entry must not take the other endpoints
    down); without it, it makes the whole slice a DecodeError. A malformed structure
    (the wrong type where a list or object belongs) is always the whole slice's error, as
    kube-proxy's typed decoding fails on it."""
    oid = _id(obj)
    md = obj.get("metadata") or {}
    service = (md.get("labels") or {}).get(SERVICE_NAME_LABEL)
    if not service:
        raise DecodeError("EndpointSlice", oid, f"metadata.labels[{SERVICE_NAME_LABEL}]", "missing")
    atype = obj.get("addressType") or "IPv4"
    endpoints = []
    append = endpoints.append  # the hot loop of a full sync: ~100k endpoints for 10k services
    v4, v6 = atype == "IPv4", atype == "IPv6"
    pton, AF_INET = socket.inet_pton, socket.AF_INET
    for i, ep in enumerate(obj.get("endpoints") or ()):
        addrs = ep.get("addresses")
        if not addrs:
            continue
        addr = addrs[0]
        if v4:
            try:
                pton(AF_INET, addr)
            except (OSError, TypeError):
                # kube-proxy parses sloppily: "010.0.0.1" (stored before Go got strict) is 10.0.0.1
                addr = ipv4_sloppy(addr) if isinstance(addr, str) else None
                if addr is None:
                    leave_out(DecodeError("EndpointSlice", oid, f"endpoints[{i}].addresses[0]",
                                          f"{addrs[0]!r} is not an IPv4 address"), skipped)
                    continue
        elif v6:
            addr = canonical_ip6(addr)
            if addr is None or "." in addr:   # an IPv4-mapped address is not an IPv6 endpoint
                leave_out(DecodeError("EndpointSlice", oid, f"endpoints[{i}].addresses[0]",
                                      f"{addrs[0]!r} is not an IPv6 address"), skipped)
                continue
        cond = ep.get("conditions")
        node = _shared(ep.get("nodeName"))   # one string per node, not one per endpoint
        if cond:  # absent ready/serving mean true, absent terminating false (as kube-proxy)
            e = Endpoint(addr, cond.get("ready") is not False, cond.get("serving") is not False,
                         cond.get("terminating") is True, node)
        else:
            e = Endpoint(addr, True, True, False, node)
        hints = ep.get("hints")
        if hints:  # rare (topology-aware services): no cost for the others
            e = e._replace(zone_hints=_hint_names(hints, "forZones", oid, i),
                           node_hints=_hint_names(hints, "forNodes", oid, i))
        append(e)
    ports = []
    for i, p in enumerate(obj.get("ports") or []):
        # An absent name is not "": kube-proxy ignores such a port (nil name)
        try:
            port = _port(p.get("port"), "EndpointSlice", oid, f"ports[{i}].port", optional=True)
        except DecodeError as err:   # kube-proxy: "Ignoring invalid endpoint port"
            leave_out(err, skipped)
            continue
        ports.append(SlicePort(name=_shared(p.get("name")), port=port, protocol=_shared(p.get("protocol") or "TCP")))
    return EndpointSlice(namespace=_shared(md.get("namespace", "")), name=md["name"], service=service,
                         address_type=_shared(atype), endpoints=tuple(endpoints), ports=tuple(ports))
