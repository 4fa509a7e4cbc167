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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from kxlb.loader.netns import netns as enter_netns

log = logging.getLogger("kxlb.healthcheck")


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        srv = self.server
        count = srv.owner.local_endpoints(srv.service)
        if count is None:  # closed meanwhile: kube-proxy does not answer either
            self.close_connection = True
            return
        healthy = srv.owner.proxy_healthy()
        ns, _, name = srv.service.partition("/")
        body = json.dumps({"service": {"namespace": ns, "name": name}, "localEndpoints": count,
                           "serviceProxyHealthy": healthy}, indent="\t").encode()
        self.send_response(200 if count and healthy else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Load-Balancing-Endpoint-Weight", str(count))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args) -> None:  # probes every few seconds: not worth a log line
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], service: str, owner: "HealthCheckServers"):
        self.service, self.owner = service, owner
        super().__init__(addr, _Handler)


class HealthCheckServers:
    """One HTTP server per (service, healthCheckNodePort), on each listen address."""

    def __init__(self, proxy_healthy: Callable[[], bool], netns: str | None = None,
                 on_error: Callable[[str, int, OSError], None] | None = None):
        self.proxy_healthy, self.netns = proxy_healthy, netns
        self.on_error = on_error
        self._lock = threading.Lock()
        self._servers: dict[str, tuple[int, list[_Server]]] = {}
        self._counts: dict[str, int] = {}

    def local_endpoints(self, service: str) -> int | None:
        with self._lock:
            return self._counts.get(service)

    def sync(self, wanted: dict[str, tuple[int, int]], addresses: tuple[str, ...]) -> None:
        """``wanted``: "ns/name" -> (port, local ready endpoints). Opens, closes and
        updates servers; a port that cannot be bound is reported and retried next sync."""
        listen = addresses or ("0.0.0.0",)
        with self._lock:
            self._counts = {svc: n for svc, (_, n) in wanted.items()}
            stale = [svc for svc, (port, _) in self._servers.items() if wanted.get(svc, (None,))[0] != port]
        for svc in stale:
            port, servers = self._servers.pop(svc)
            log.info("closing health check of %s on port %d", svc, port)
            for s in servers:
                s.shutdown()
                s.server_close()
        for svc, (port, _) in wanted.items():
            if svc in self._servers:
                continue
            servers = []
            try:
                for addr in listen:
                    with enter_netns(self.netns):  # the socket stays in the node's namespace
                        s = _Server((addr, port), svc, self)
                    threading.Thread(target=s.serve_forever, name=f"hc-{port}", daemon=True).start()
                    servers.append(s)
            except OSError as exc:
                for s in servers:
                    s.shutdown()
                    s.server_close()
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
