"""kube-proxy's health contract (pkg/proxy/healthcheck/proxy_health.go), served on
--healthz-bind-address (default 0.0.0.0:10256), where cloud load balancers and the
kubelet probe kube-proxy:

- ``/livez``: 200 while no change has waited for a sync longer than the health timeout
  (twice the sync period), else 503;
- ``/healthz``: the same, and 503 while this Node is being deleted or is tainted
  ToBeDeletedByClusterAutoscaler (so load balancers drain it first);
- both answer kube-proxy's JSON: lastUpdated, currentTime, healthy, nodeEligible
  (/healthz only), status per IP family.
"""
from __future__ import annotations

import datetime as dt
import json
import threading
import time

from .httpserve import TEXT, Handler, Server

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
FAMILY = "IPv4"
JSON = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


class ProxyHealth:
    """The sync loop reports queued changes and completed syncs; probes read health."""

    def __init__(self, health_timeout: float, clock=time.time):
        self.health_timeout, self.clock = health_timeout, clock
        self._lock = threading.Lock()
        self._last_updated: float | None = None
        self._oldest_pending: float | None = None
        self.node_eligible = False   # until the Node is seen
        self.counts: dict[tuple[str, int], int] = {}  # (endpoint, code) -> requests

    def queued_update(self) -> None:
        if self._oldest_pending is not None or self._last_updated is None:
            # Already pending; or still starting (kube-proxy queues only once its sync loop
            # runs: a slow initial list must not get the proxy restarted).
            return
        with self._lock:
            if self._oldest_pending is None:
                self._oldest_pending = self.clock()

    def updated(self) -> None:
        with self._lock:
            self._oldest_pending = None
            self._last_updated = self.clock()

    def set_node(self, node: dict | None) -> None:
        """From the Node object: eligible unless deleted, being deleted, or tainted."""
        if node is None:
            self.node_eligible = False
            return
        md, spec = node.get("metadata") or {}, node.get("spec") or {}
        self.node_eligible = not md.get("deletionTimestamp") and \
            not any(t.get("key") == TO_BE_DELETED_TAINT for t in spec.get("taints") or ())

    def health(self) -> dict:
        with self._lock:
            now = self.clock()
            healthy = self._oldest_pending is None or now - self._oldest_pending < self.health_timeout
            last = self._last_updated
        out = {"lastUpdated": _rfc3339(last) if last else "0001-01-01T00:00:00Z", "currentTime": _rfc3339(now),
               "healthy": healthy}
        if last is not None:
            out["status"] = {FAMILY: {"lastUpdated": out["lastUpdated"], "healthy": healthy}}
        return out

    @property
    def healthy(self) -> bool:
        return self.health()["healthy"]

    def answer(self, path: str) -> tuple[int, dict] | None:
        """(HTTP status, JSON body) for /healthz or /livez; None for any other path."""
        if path not in ("/healthz", "/livez"):
            return None
        h = self.health()
        ok = h["healthy"]
        if path == "/healthz":
            h["nodeEligible"] = self.node_eligible
            ok = ok and self.node_eligible
        if ok:
            h["lastUpdated"] = h["currentTime"]  # as kube-proxy: a healthy answer is current
        code = 200 if ok else 503
        with self._lock:
            self.counts[(path[1:], code)] = self.counts.get((path[1:], code), 0) + 1
        return code, h


def health_handler(health: ProxyHealth, on_request=None) -> Handler:
    """/healthz and /livez answered from ``health`` as kube-proxy's handlers answer, 404
    otherwise; ``on_request(endpoint, code)`` counts the answers."""
    def handle(path: str) -> tuple[int, dict[str, str], bytes]:
        got = health.answer(path)
        if got is None:
            return 404, TEXT, b"404 page not found\n"
        code, doc = got
        if on_request is not None:
            on_request(path[1:], code)
        return code, JSON, json.dumps(doc).encode()
    return handle


def serve_health(health: ProxyHealth, host: str, port: int, on_request=None) -> Server:
    """kube-proxy's health server (--healthz-bind-address), in the calling thread's
    network namespace."""
    return Server(host, port, health_handler(health, on_request), name="healthz")
