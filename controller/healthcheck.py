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


class HealthCheckServers:
    """One HTTP server per (service, healthCheckNodePort), on each listen address."""

    def __init__(self, proxy_healthy: Callable[[], bool], netns: str | None = None,
                 on_error: Callable[[str, int, OSError], None] | None = None):
        self.proxy_healthy, self.netns = proxy_healthy, netns
        self.on_error = on_error
        self._lock = threading.Lock()
        self._servers: dict[str, tuple[int, list[Server]]] = {}
        self._counts: dict[str, int] = {}

    def local_endpoints(self, service: str) -> int | None:
        with self._lock:
            return self._counts.get(service)

    def _answer(self, service: str, path: str) -> tuple[int, dict[str, str], bytes]:
        """Any path, as kube-proxy's handler. A service whose server is being closed
        counts no local endpoint."""
        count = self.local_endpoints(service) or 0
        healthy = self.proxy_healthy()
        ns, _, name = service.partition("/")
        body = json.dumps({"service": {"namespace": ns, "name": name}, "localEndpoints": count,
                           "serviceProxyHealthy": healthy}, indent="\t").encode()
        return 200 if count and healthy else 503, {**JSON, "X-Load-Balancing-Endpoint-Weight": str(count)}, body

    def sync(self, wanted: dict[str, tuple[int, int]], addresses: tuple[str, ...]) -> None:
        """``wanted``: "ns/name" -> (port, local ready endpoints). Opens, closes and
        updates servers; a port that cannot be bound is reported and retried next sync."""
        listen = addresses or ("0.0.0.0",)  # every address, both families (httpserve)
        with self._lock:
            self._counts = {svc: n for svc, (_, n) in wanted.items()}
            stale = [svc for svc, (port, _) in self._servers.items() if wanted.get(svc, (None,))[0] != port]
        for svc in stale:
            port, servers = self._servers.pop(svc)
            log.info("closing health check of %s on port %d", svc, port)
            for s in servers:
                s.close()
        for svc, (port, _) in wanted.items():
            if svc in self._servers:
                continue
            servers = []
            try:
                for addr in listen:  # each address a listener of its own family
                    with enter_netns(self.netns):  # the socket stays in the node's namespace
                        servers.append(Server(addr, port, lambda path, svc=svc: self._answer(svc, path),
                                              name=f"health check {svc}"))
            except OSError as exc:
                for s in servers:
                    s.close()
                log.error("health check of %s: cannot listen on port %d: %s", svc, port, exc)
                if self.on_error:
                    self.on_error(svc, port, exc)
                continue
            log.info("health check of %s on port %d (%s)", svc, port, ", ".join(listen))
            self._servers[svc] = (port, servers)

    def close(self) -> None:
        self.sync({}, ())

    @property
    def ports(self) -> dict[str, int]:
        return {svc: port for svc, (port, _) in self._servers.items()}
