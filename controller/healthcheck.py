"""healthCheckNodePort servers, as kube-proxy's (pkg/proxy/healthcheck/service_health.go).

A LoadBalancer Service with externalTrafficPolicy Local gets spec.healthCheckNodePort;
the cloud load balancer probes it on every node to send traffic only to nodes that have
a local endpoint. Each such port answers any path with:
  200 when this node has at least one local ready endpoint and the proxy is healthy,
  503 otherwise,
a JSON body {"service": {"namespace", "name"}, "localEndpoints": N,
"serviceProxyHealthy": bool} and the header X-Load-Balancing-Endpoint-Weight: N.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from kxlb.loader.netns import netns as enter_netns

from .health import JSON
from .httpserve import Server

log = logging.getLogger("kxlb.healthcheck")


Key = tuple[str, str]   # ("ns/name", family): the model's Desired.health_checks keys
WILDCARD = {"IPv4": "0.0.0.0", "IPv6": "::"}


class HealthCheckServers:
    """kube-proxy's service health servers, one set per IP family
    (pkg/proxy/healthcheck/service_health.go, one per proxier): for each (Service,
    family), the Service's healthCheckNodePort on that family's NodePort addresses, or on
    every address of the family when its nodePortAddresses match all, answering with the
    family's local endpoints. A probe over IPv6 is told about IPv6 endpoints; a family
    whose port cannot be bound leaves the other family's listening."""

    def __init__(self, proxy_healthy: Callable[[], bool], netns: str | None = None,
                 on_error: Callable[[str, int, OSError], None] | None = None):
        self.proxy_healthy, self.netns = proxy_healthy, netns
        self.on_error = on_error
        self._lock = threading.Lock()
        self._servers: dict[Key, tuple[int, tuple[str, ...], list[Server]]] = {}
        self._counts: dict[Key, int] = {}

    def local_endpoints(self, key: Key) -> int | None:
        with self._lock:
            return self._counts.get(key)

    def _answer(self, key: Key, path: str) -> tuple[int, dict[str, str], bytes]:
        """Any path, as kube-proxy's handler. A service whose server is being closed
        counts no local endpoint."""
        count = self.local_endpoints(key) or 0
        healthy = self.proxy_healthy()
        ns, _, name = key[0].partition("/")
        body = json.dumps({"service": {"namespace": ns, "name": name}, "localEndpoints": count,
                           "serviceProxyHealthy": healthy}, indent="\t").encode()
        return 200 if count and healthy else 503, {**JSON, "X-Load-Balancing-Endpoint-Weight": str(count)}, body

    def sync(self, wanted: dict[Key, tuple[int, int]], listen: dict[str, tuple[str, ...] | None]) -> int:
        """``wanted``: (service, family) -> (port, local ready endpoints of the family);
        ``listen``: family -> its addresses, None for every address of the family.
        Opens, closes and updates servers; a port that cannot be bound is reported and
        retried next sync. Returns how many could not be bound."""
        failed = 0
        hosts = {key: (WILDCARD[key[1]],) if listen.get(key[1], ()) is None else listen.get(key[1], ())
                 for key in wanted}
        with self._lock:
            self._counts = {key: n for key, (_, n) in wanted.items()}
            stale = [key for key, (port, addrs, _) in self._servers.items()
                     if key not in wanted or (wanted[key][0], hosts[key]) != (port, addrs)]
        for key in stale:
            port, _, servers = self._servers.pop(key)
            log.info("closing %s health check of %s on port %d", key[1], key[0], port)
            for s in servers:
                s.close()
        for key, (port, _) in wanted.items():
            if key in self._servers or not hosts[key]:  # no address of the family selected
                continue
            servers = []
            try:
                for addr in hosts[key]:
                    with enter_netns(self.netns):  # the socket stays in the node's namespace
                        servers.append(Server(addr, port, lambda path, key=key: self._answer(key, path),
                                              name=f"health check {key[0]} {key[1]}", family_only=True))
            except OSError as exc:
                for s in servers:
                    s.close()
                log.error("%s health check of %s: cannot listen on port %d: %s", key[1], key[0], port, exc)
                if self.on_error:
                    self.on_error(key[0], port, exc)
                failed += 1
                continue
            log.info("%s health check of %s on port %d (%s)", key[1], key[0], port, ", ".join(hosts[key]))
            self._servers[key] = (port, hosts[key], servers)
        return failed

    def close(self) -> None:
        self.sync({}, {})

    @property
    def ports(self) -> dict[Key, int]:
        return {key: port for key, (port, _, _) in self._servers.items()}
