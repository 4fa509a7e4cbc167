"""Prometheus metrics (kube-proxy's names under the kxlb_ prefix where the meaning is the
same, so dashboards translate) and the health endpoints, on one HTTP listener."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .health import health_handler
from .httpserve import TEXT, Server

SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# kube-proxy's network-programming buckets (pkg/proxy/metrics): 0.25 s .. 5 min, plus
# finer ones below its first, since a BPF map write takes milliseconds.
PROGRAMMING_BUCKETS = tuple(sorted({0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5} | set(range(1, 60)) |
                                   set(range(60, 120, 5)) | set(range(120, 301, 30))))


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sync_duration = Histogram("kxlb_sync_proxy_rules_duration_seconds",
                                       "Time to apply a sync to the BPF maps", registry=r, buckets=SYNC_BUCKETS)
        self.sync_full_duration = Histogram("kxlb_sync_full_proxy_rules_duration_seconds",
                                            "Time of full syncs", registry=r, buckets=SYNC_BUCKETS)
        self.sync_partial_duration = Histogram("kxlb_sync_partial_proxy_rules_duration_seconds",
                                               "Time of incremental syncs", registry=r, buckets=SYNC_BUCKETS)
        self.last_sync = Gauge("kxlb_sync_proxy_rules_last_timestamp_seconds",
                               "Unix time of the last successful sync", registry=r)
        self.network_programming = Histogram(
            "kxlb_network_programming_duration_seconds",
            "From an endpoints change (EndpointSlice last-change-trigger-time) to the maps programmed",
            registry=r, buckets=PROGRAMMING_BUCKETS)
        self.last_queued = Gauge("kxlb_sync_proxy_rules_last_queued_timestamp_seconds",
                                 "Unix time of the last change queued for a sync", registry=r)
        self.service_changes_pending = Gauge("kxlb_sync_proxy_rules_service_changes_pending",
                                             "Services changed and not yet synced", registry=r)
        self.endpoint_changes_pending = Gauge("kxlb_sync_proxy_rules_endpoint_changes_pending",
                                              "EndpointSlice changes not yet synced", registry=r)
        self.sync_failures = Counter("kxlb_sync_proxy_rules_failures_total",
                                     "Syncs that raised (logged with their traceback, then retried)", registry=r)
        self.healthz = Counter("kxlb_proxy_healthz_total", "/healthz answers by HTTP code", ["code"], registry=r)
        self.livez = Counter("kxlb_proxy_livez_total", "/livez answers by HTTP code", ["code"], registry=r)
        self.service_changes = Counter("kxlb_sync_proxy_rules_service_changes_total",
                                       "Service events seen", registry=r)
        self.endpoint_changes = Counter("kxlb_sync_proxy_rules_endpoint_changes_total",
                                        "EndpointSlice events seen", registry=r)
        self.services_programmed = Gauge("kxlb_services_programmed", "Service ports (VIP:port/proto) in the maps",
                                         ["ip_family"], registry=r)
        self.endpoints_programmed = Gauge("kxlb_endpoints_programmed", "Backend slots in the maps",
                                          ["ip_family"], registry=r)
        self.handler_errors = Counter("kxlb_informer_handler_errors_total",
                                      "Events a handler raised on (kept and retried), by resource",
                                      ["resource"], registry=r)
        self.watch_restarts = Counter("kxlb_watch_restarts_total", "Watches restarted, by resource and reason",
                                      ["resource", "reason"], registry=r)
        self.no_local_endpoints = Gauge(
            "kxlb_sync_proxy_rules_no_local_endpoints_total",
            "Service ports whose Local traffic policy has no local endpoint while endpoints exist elsewhere "
            "(kube-proxy's gauge of the same name)", ["traffic_policy"], registry=r)
        self.map_entries = Gauge("kxlb_map_entries", "Entries in a BPF map", ["map"], registry=r)
        self.map_capacity = Gauge("kxlb_map_capacity", "Capacity of a BPF map", ["map"], registry=r)
        self.drift_repaired = Counter("kxlb_drift_repaired_total",
                                      "Services found altered in the maps and rewritten", registry=r)
        self.drift_check_duration = Histogram(
            "kxlb_drift_check_duration_seconds",
            "Time of one sync run's share of the drift check (the whole node once a full-sync period)",
            registry=r, buckets=SYNC_BUCKETS)
        self.objects_skipped = Counter("kxlb_objects_skipped_total", "Objects or ports skipped as invalid",
                                       ["kind"], registry=r)
        # Labelled by family as kube-proxy's (a dual-stack kube-proxy runs one proxier each).
        self.udp_flows_flushed = Counter("kxlb_conntrack_reconciler_deleted_entries_total",
                                         "Conntrack entries of UDP flows to endpoints no longer serving, deleted",
                                         ["ip_family"], registry=r)
        self.conntrack_reconcile = Histogram("kxlb_conntrack_reconciler_sync_duration_seconds",
                                             "Time of one UDP conntrack cleanup pass", ["ip_family"], registry=r,
                                             buckets=SYNC_BUCKETS)
        self.ready = threading.Event()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def serve(metrics: Metrics, host: str, port: int, health=None, proxy_mode: str = "kxlb") -> Server:
    """/metrics; /proxyMode and /healthz as kube-proxy's metrics port (tools and e2e tests
    ask them; its /healthz is client-go's ping check: "ok" while the process answers, the
    proxy's health is the health port's); /livez (with ``health``, a
    controller.health.ProxyHealth: the health port's answer; kxlb's own) and /readyz
    (first sync done)."""
    health_answer = health_handler(health) if health is not None else None

    def handle(path: str) -> tuple[int, dict[str, str], bytes]:
        if path == "/metrics":
            return 200, {"Content-Type": CONTENT_TYPE_LATEST}, metrics.render()
        if path == "/proxyMode":
            return 200, TEXT, proxy_mode.encode()
        if path == "/healthz":
            return 200, TEXT, b"ok"
        if path == "/livez":
            return health_answer(path) if health_answer else (200, TEXT, b"ok\n")
        if path == "/readyz":
            ok = metrics.ready.is_set()
            return (200, TEXT, b"ok\n") if ok else (503, TEXT, b"not synced yet\n")
        return 404, TEXT, b"not found\n"

    return Server(host, port, handle, name="metrics")
