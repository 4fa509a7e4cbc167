"""The controller's runtime: informers feed a change tracker; a rate-limited sync
runner turns the changed services into map writes (kube-proxy's pkg/proxy shape).

Threads: one per informer (they only record changes), one sync loop (the only writer
of the maps), the metrics HTTP server, and the interface attacher.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import FAMILIES, V4, V6
from kxlb.loader.maps import Maps
from kxlb.loader.services import DatapathConfig

from .decode import DecodeError, canonical_ip6
from .dpconfig import datapath_config
from .health import ProxyHealth
from .healthcheck import HealthCheckServers
from .informer import DELETED, Informer, WatchTiming
from .metrics import Metrics
from .conntrack import clean_stale_udp_flows, serving_by_frontend
from .socks import UdpSocketReaper
from .model import IPV4, IPV6, Desired, NodeContext, family_of, service_entries
from .node import (NodePortSelection, decode_node, interface_addresses, masquerade_port_range,
                   nodeport_selection, select_nodeport_addresses)
from .programmer import ApplyResult, Programmer
from .runner import BoundedFrequencyRunner
from .sweep import DriftSweep
from .tracker import ChangeTracker

log = logging.getLogger("kxlb.controller")

# kube-proxy's selector: services (and their slices, which inherit the labels) that
# another proxy implements, and headless ones, are not ours.
# kube-proxy's informers (cmd/kube-proxy/app/server.go): Services another proxy owns and
# headless Services (by field: the API server never sends them) are not watched, nor the
# EndpointSlices of headless Services.
SERVICE_SELECTOR = {"label_selector": "!service.kubernetes.io/service-proxy-name",
                    "field_selector": "spec.clusterIP!=None"}
SLICE_SELECTOR = {"label_selector": "!service.kubernetes.io/headless"}


@dataclass
class ControllerConfig:
    node_name: str
    min_sync_period: float = 0.0     # seconds between two syncs at least (kube-proxy: 1 s)
    reconcile_period: float = 30.0   # a run at least this often (kube-proxy's syncPeriod: 30 s)
    full_sync_period: float = 3600.0  # every map checked for drift once a period (kube-proxy's FullSyncPeriod: 1 h)
    timing: WatchTiming | None = None
    cluster_cidrs: tuple[str, ...] = ()  # one per family: clients outside are masqueraded (--cluster-cidr)
    masquerade_address: str | None = None  # default: the Node's InternalIP (of each family)
    masquerade_all: bool = False     # masquerade every new flow to a cluster IP (--masquerade-all)
    # kube-proxy's nodePortAddresses: keywords (primary, localhost, all) and CIDRs; () is primary
    nodeport_addresses: tuple[str, ...] = ()
    netns: str | None = None         # where the node's interfaces are (NodePort addresses are theirs)
    healthcheck_servers: bool = True  # serve healthCheckNodePorts
    retry_initial: float = 1.0       # first retry after a failed sync (then doubling)
    detect_local_node_cidr: bool = False  # pods = the Node's podCIDRs, not cluster_cidrs (NodeCIDR mode)
    maglev_table_size: int = 16381   # largest Maglev table (prime; loader/maglev.py sizes smaller sets)
    node_port_range: tuple[int, int] = (30000, 32767)  # the cluster's NodePorts (apiserver's flag)
    masquerade_ports: tuple[int, int] | None = None    # --masquerade-ports; None: chosen (node.py)


def tune_gc() -> None:
    """Syncs allocate many short-lived objects while the caches hold hundreds of
    thousands of long-lived ones: collect the young generation less often (the default
    threshold of 700 makes a 10k-service sync spend most of its time in the collector)."""
    gc.set_threshold(100_000, 50, 100)


def settle_memory(freeze: bool = False) -> None:
    """After a full pass: collect what it left (syncs run with the collector off), with
    ``freeze`` keep the collector off the caches just built (they are long-lived), and give
    the heap's free pages back to the kernel. glibc keeps memory that was freed for reuse,
    so the first sync's transient peak (lists decoded, specs compared, batches packed)
    would otherwise stay in the RSS for the life of the process (19 MB at 30,000 Services
    in bench/controller.py); malloc_trim(0) releases it. Not glibc: nothing to trim."""
    gc.collect()
    if freeze:
        gc.freeze()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class Controller:
    """``api_client`` None: no informers (events are fed to on_service/on_slice by the
    caller, as the benchmark does)."""

    def __init__(self, api_client, maps: Maps, config: ControllerConfig, metrics: Metrics | None = None,
                 events=None, journal=None, ids=None):
        tune_gc()
        self.maps, self.config = maps, config
        self.metrics = metrics or Metrics()
        self.events = events  # EventRecorder or None
        # journal (loader/journal.py) and ids (loader/svcids.py): a writer's records in the pin dir
        self.programmer = Programmer(maps, config.maglev_table_size, journal, ids)
        self._lock = threading.Lock()
        self.tracker = ChangeTracker(on_invalid=self._skip)   # informers -> what changed
        self.fragments: dict[str, Desired] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._node_ip: str | None = None       # node IP of IPv4 (GetNodeHostIPs)
        self._node_ip6: str | None = None      # node IP of IPv6
        self._node_ips: tuple[str, ...] = ()
        self._nodeport_selection: dict[int, NodePortSelection] = {}
        self._addresses_read = 0.0             # when the interfaces' addresses were last read
        self._local_addrs: frozenset[str] | None = None   # what they were (None: not read yet)
        self._node_external: frozenset[str] = frozenset()  # node IPs taken from ExternalIPs
        self._node_zone: str | None = None
        self._node_pod_cidrs: tuple[str, ...] = ()
        self._node_ctx: NodeContext | None = None
        self._service_cidrs: dict[str, tuple[str, ...]] = {}   # ServiceCIDR name -> its CIDRs
        self._dp_config: DatapathConfig | None = None  # what the config map holds
        self._src_ports: tuple[int, int] | tuple[()] | None = None  # masquerade ports, read once
        self._node_dirty = False
        self._force_full = True          # the first sync, and the one after a failure
        self._last_queued = 0.0
        self._health_checks: dict[tuple[str, str], tuple[int, int]] = {}   # over every Service's fragment
        self._udp_serving: dict = {}
        self._no_local: Counter = Counter({"internal": 0, "external": 0})
        self._service_state_changed = True
        self._udp_changed = False
        # Read at scrape time: nothing to do per event.
        self.metrics.last_queued.set_function(lambda: self._last_queued)
        self.metrics.service_changes_pending.set_function(lambda: self.tracker.pending)
        self.metrics.endpoint_changes_pending.set_function(lambda: self.tracker.slice_changes)
        for fam in FAMILIES:
            self.metrics.endpoints_programmed.labels(fam.name).set_function(
                lambda fam=fam: self.programmer.table.slots_used_by(fam))
        self._sweep = DriftSweep(config.full_sync_period)   # the drift check, spread over the period
        self._sweep_keys: list = []
        self._sweep_entries: Sequence = ()
        self._started = time.time()      # network-programming latency: only changes after this
        self.health = ProxyHealth(2 * config.reconcile_period)
        self.runner = BoundedFrequencyRunner("sync", self._run_once, config.min_sync_period,
                                             max(config.reconcile_period, config.min_sync_period),
                                             retry_initial=config.retry_initial,
                                             retry_max=max(config.reconcile_period, config.retry_initial),
                                             on_error=self._sync_failed)
        self.healthchecks = HealthCheckServers(self._proxy_healthy, config.netns) if config.healthcheck_servers else None
        self.syncs = 0
        self.informers = self._informers(api_client) if api_client is not None else []
        # Connected UDP sockets of host-network processes to endpoints that left
        # (controller/socks.py), destroyed beside the UDP conntrack cleanup.
        self.udp_sockets = UdpSocketReaper(maps.pin_dir, config.netns, self.metrics.registry)
        for cap_map in ("services", "backends", "conntrack", "services6", "backends6", "conntrack6"):
            self.metrics.map_capacity.labels(cap_map).set(getattr(maps, cap_map).max_entries)

    def _informers(self, api_client) -> list[Informer]:
        from kubernetes import client as k8s

        core, disc = k8s.CoreV1Api(api_client), k8s.DiscoveryV1Api(api_client)
        restart = lambda res, reason: self.metrics.watch_restarts.labels(res, reason).inc()  # noqa: E731
        failed = lambda res, key, exc: self.metrics.handler_errors.labels(res).inc()  # noqa: E731
        timing = self.config.timing
        return [
            Informer("services", core.list_service_for_all_namespaces, self.on_service,
                     dict(SERVICE_SELECTOR), timing, restart, on_handler_error=failed),
            Informer("endpointslices", disc.list_endpoint_slice_for_all_namespaces, self.on_slice,
                     dict(SLICE_SELECTOR), timing, restart, on_handler_error=failed),
            Informer("nodes", core.list_node, self._on_node,
                     {"field_selector": f"metadata.name={self.config.node_name}"}, timing, restart,
                     on_handler_error=failed),
            Informer("servicecidrs", k8s.NetworkingV1Api(api_client).list_service_cidr, self.on_service_cidr,
                     {}, timing, restart, on_handler_error=failed),
        ]

    # --- change tracking (informer threads) ------------------------------------------------
    def on_service(self, typ: str, key: str, obj: dict) -> None:
        self.metrics.service_changes.inc()
        if self.tracker.service(typ, key, obj):
            self._queued()

    def on_slice(self, typ: str, key: str, obj: dict) -> None:
        self.metrics.endpoint_changes.inc()
        if self.tracker.slice(typ, key, obj):
            self._queued()

    def _queued(self) -> None:
        """A change waits for the sync loop (kube-proxy's QueuedUpdate). Called per event:
        a full list hands over tens of thousands, so it stays cheap."""
        self.health.queued_update()
        self._last_queued = time.time()
        self.runner.run()

    def _on_node(self, typ: str, key: str, obj: dict) -> None:
        self.health.set_node(None if typ == DELETED else obj)  # /healthz: a node going away drains
        if typ == DELETED:
            return  # keep serving with what we knew (kube-proxy does too)
        skipped: list[DecodeError] = []
        try:
            node = decode_node(obj, skipped)
        except DecodeError as exc:
            self._skip(exc, obj)
            return
        for exc in skipped:   # an address left out, the others used
            self._skip(exc, obj)
        with self._lock:
            cidr_changed, self._node_pod_cidrs = node.pod_cidrs != self._node_pod_cidrs, node.pod_cidrs
            if (node.ips, node.zone, node.external) == (self._node_ips, self._node_zone, self._node_external):
                if cidr_changed and self.config.detect_local_node_cidr:
                    self._queued()  # the datapath config follows in the next sync
                return
            log.info("node %s: node IPs %s, zone %s", node.name, ", ".join(node.ips) or "(none)", node.zone)
            self._node_ips, self._node_zone, self._node_external = node.ips, node.zone, node.external
            self._node_ip, self._node_ip6 = node.first_ip(4), node.first_ip(6)
            self._node_dirty = True  # NodePort addresses and topology: every service again
        self._queued()

    def on_service_cidr(self, typ: str, key: str, obj: dict) -> None:
        cidrs = () if typ == DELETED else tuple(c for c in (obj.get("spec") or {}).get("cidrs") or ()
                                                if isinstance(c, str))
        with self._lock:
            if cidrs:
                self._service_cidrs[key] = cidrs
            else:
                self._service_cidrs.pop(key, None)
        self._queued()

    def _proxy_healthy(self) -> bool:
        """serviceProxyHealthy of the health check servers: kube-proxy's proxy health (no
        change waiting longer than the health timeout), once the first sync is done."""
        return self.metrics.ready.is_set() and self.health.healthy

    def node_context(self) -> NodeContext:
        """This node as the service model needs it: NodePort addresses are the addresses
        of the node's interfaces that nodePortAddresses selects (kube-proxy's GetNodeIPs),
        read now."""
        self._nodeport_selection = nodeport_selection(self.config.nodeport_addresses, self._node_ips)
        self._addresses_read = time.monotonic()
        try:
            local = interface_addresses(self.config.netns)
        except (OSError, KxlbError) as exc:
            log.error("nodePortAddresses: cannot read the node's addresses: %s; NodePorts are not served", exc)
            local = []
        else:
            self._local_addrs = frozenset(canonical_ip6(a) if ":" in a else a for a in local if a)
        addrs = select_nodeport_addresses(self._nodeport_selection, local)
        return NodeContext(name=self.config.node_name, zone=self._node_zone, nodeport_addresses=addrs,
                           ip=self._node_ip, ip6=self._node_ip6)

    def _addresses_changed(self) -> NodeContext | None:
        """The node's addresses are read again once a reconcile period (kube-proxy reads
        them every sync): an address added to or removed from an interface moves the
        NodePorts with it. The new context when they moved (a full sync follows), else None."""
        if self._node_ctx is None or time.monotonic() - self._addresses_read < self.config.reconcile_period:
            return None
        now = self.node_context()
        if now == self._node_ctx:
            return None
        log.info("node addresses changed: NodePorts now on %s", ", ".join(now.nodeport_addresses) or "(none)")
        return now

    def _skip(self, exc: DecodeError, obj: dict) -> None:
        log.error("skipping %s", exc)
        self.metrics.objects_skipped.labels(exc.kind).inc()
        if self.events:
            self.events.warn(exc.kind, obj, "KxlbInvalidObject", str(exc))

    # --- sync loop -------------------------------------------------------------------------
    def start(self) -> "Controller":
        for inf in self.informers:
            inf.start()
        self._thread = threading.Thread(target=self._loop, name="sync", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.runner.stop()
        for inf in self.informers:
            inf.stop()
        if getattr(self, "_thread", None):
            self._thread.join(timeout=10)
        if self.healthchecks is not None:
            self.healthchecks.close()

    def _loop(self) -> None:
        """Nothing is programmed until Services, EndpointSlices and the Node have synced
        once; then the runner's first run is a full sync against what the pinned maps
        already hold (adoption)."""
        while not self._stop.is_set():
            if all(inf.synced.is_set() for inf in self.informers[:3]):
                break
            self._stop.wait(0.05)
        if not self._stop.is_set():
            self.health.updated()  # as kube-proxy's SyncLoop: healthy from here, until a change waits too long
            self.runner.loop()

    def _run_once(self) -> None:
        """One run of the sync runner: incremental, then the share of the drift check
        that is due (controller/sweep.py). Full, with every map read, only at the start
        (adoption), after a failed run, and when the check found drift."""
        if self._force_full:
            self.reconcile()
            self._sweep.checked_all(time.monotonic())
            first = not self.metrics.ready.is_set()
            settle_memory(freeze=first)
            if first:
                self.metrics.ready.set()
            self._force_full = False
        else:
            self.sync(full=False)
            self._check_drift()
        self.health.updated()

    def _check_drift(self) -> None:
        """This run's share of the drift check: the service ports and frontend entries of
        the cycle that are due. Drift is rare (an edit behind our back): the repair is the
        full pass, which reads every map and rewrites what differs."""
        new, lo, hi = self._sweep.step(time.monotonic())
        if new:
            self._sweep_keys = list(self.programmer.current)
            self._sweep_entries = self.programmer.table.frontend_snapshot()
            self._count_map_entries()
            self._udp_changed = True          # the cycle's UDP conntrack scan, in this run
            self._service_state_changed = True
        t0 = time.perf_counter()
        found = self.programmer.drift(DriftSweep.part(self._sweep_keys, lo, hi),
                                      DriftSweep.part(self._sweep_entries, lo, hi))
        self.metrics.drift_check_duration.observe(time.perf_counter() - t0)
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            log.warning("drift in the maps: %s%s; reading every map to repair it", ", ".join(found[:3]), more)
            self.reconcile()
            self._sweep.checked_all(time.monotonic())

    def _sync_failed(self, exc: BaseException) -> None:
        """A run raised: count it, forget what the table believes the maps hold (a write
        may have stopped half way), and make the retry a full sync (the dirty set of the
        failed run is gone)."""
        self.metrics.sync_failures.inc()
        self.programmer.table.forget()
        self._force_full = True

    def sync(self, full: bool) -> ApplyResult:
        """Apply the changed services (all of them if ``full``). The collector is off
        meanwhile: a sync only allocates, and frees at the end."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._sync(full)
        finally:
            if enabled:
                gc.enable()

    def _sync(self, full: bool) -> ApplyResult:
        t0 = time.perf_counter()
        with self._lock:
            if self._node_dirty:
                full, self._node_dirty = True, False
        moved = None if full else self._addresses_changed()   # read: not read again below
        full = full or moved is not None
        work, triggers = self.tracker.checkout(full, also=self.fragments)
        node = self._node_ctx = moved or (self.node_context() if full or self._node_ctx is None else self._node_ctx)
        if full:
            self._service_state_changed = True  # listen addresses may have changed too
        desired: dict = {}
        scope: set = set()
        for sid, svc, slices in work:
            frag = Desired()
            if svc is not None:
                service_entries(svc, slices, frag, node)
            old = self.fragments.get(sid)
            scope |= set(frag.services) | (set(old.services) if old else set())
            desired.update(frag.services)
            for reason in frag.skipped:
                log.warning("skipping %s", reason)
                self.metrics.objects_skipped.labels("ServicePort").inc()
            self._account_fragment(old, frag)
            if svc is None:
                self.fragments.pop(sid, None)
            else:
                self.fragments[sid] = frag
        self._apply_config()
        res = self.programmer.apply(desired, scope=None if full else scope)
        for msg in res.failed:
            log.error("not programmed: %s", msg)
            self.metrics.objects_skipped.labels("MapWrite").inc()
        self._clean_udp_conntrack(full)
        if self._service_state_changed:
            self._publish_service_state(node)
        elapsed = time.perf_counter() - t0
        self.metrics.sync_duration.observe(elapsed)
        (self.metrics.sync_full_duration if full else self.metrics.sync_partial_duration).observe(elapsed)
        self.metrics.last_sync.set(time.time())
        now = time.time()
        for t in triggers:
            if t >= self._started:  # kube-proxy's start-time filter: no stale samples after a restart
                self.metrics.network_programming.observe(max(0.0, now - t))
        cur = self.programmer.current
        v6 = sum(1 for k in cur if ":" in k.vip)
        self.metrics.services_programmed.labels("IPv4").set(len(cur) - v6)
        self.metrics.services_programmed.labels("IPv6").set(v6)
        self.syncs += 1
        if res.changed:
            log.info("%s sync: %d added, %d updated, %d deleted in %.1f ms", "full" if full else "partial",
                     res.added, res.updated, res.deleted, elapsed * 1000)
        if res.transient:
            raise SyncIncomplete(f"{len(res.failed)} service ports not written: {res.failed[0]}")
        return res

    def _account_fragment(self, old: Desired | None, new: Desired) -> None:
        """Keep the per-Service aggregates (health checks, no-local counts, UDP serving
        sets) up to date by difference, so a sync costs what changed, not every Service."""
        if old is not None:
            # Only what is still old's: another Service in this sync may already have
            # taken the same key (a Service deleted and recreated under the same cluster IP).
            for k, v in old.health_checks.items():
                if self._health_checks.get(k) is v:
                    del self._health_checks[k]
            for k, v in old.udp_serving.items():
                if self._udp_serving.get(k) is v:
                    del self._udp_serving[k]
            self._no_local.subtract(old.no_local)
        self._health_checks.update(new.health_checks)
        self._udp_serving.update(new.udp_serving)
        if old is not None and any(not serving <= new.udp_serving.get(k, frozenset())
                                   for k, serving in old.udp_serving.items()):
            self._udp_changed = True   # an endpoint stopped serving: its UDP flows are stale
        self._no_local.update(new.no_local)
        if (old is not None and (old.health_checks or any(old.no_local.values()))) or new.health_checks or \
                any(new.no_local.values()):
            self._service_state_changed = True

    def _clean_udp_conntrack(self, full: bool) -> None:
        """kube-proxy rescans after every sync (controller/conntrack.py); a stale flow can
        only appear when an endpoint stops serving (or one raced the write of that change),
        so the scan runs on those syncs, on every full one, and once a drift cycle (for
        the racers)."""
        if not self._udp_serving or not (full or self._udp_changed):
            return
        self._udp_changed = False
        cur = self.programmer.current
        ports = [(cur[k].spec, serving) for k, serving in self._udp_serving.items() if k in cur]
        serving = serving_by_frontend(ports)
        for fam in FAMILIES:
            t0 = time.perf_counter()
            n = clean_stale_udp_flows(self.maps, serving, fam)
            self.metrics.conntrack_reconcile.labels(fam.name).observe(time.perf_counter() - t0)
            if n:
                self.metrics.udp_flows_flushed.labels(fam.name).inc(n)
                log.info("deleted %d %s conntrack entries of UDP flows to endpoints no longer serving", n, fam.name)
        n = self.udp_sockets.reap_logged(serving)
        if n:
            log.info("destroyed %d connected UDP sockets of host processes to endpoints no longer serving", n)

    def _publish_service_state(self, node: NodeContext) -> None:
        """What is per Service rather than per map entry: health check servers and the
        no-local-endpoints gauges."""
        self._service_state_changed = False
        for policy in ("internal", "external"):
            self.metrics.no_local_endpoints.labels(policy).set(self._no_local[policy])
        if self.healthchecks is not None:
            # kube-proxy's per-family health servers: every address of a family its
            # nodePortAddresses match all of, else the family's NodePort addresses
            listen = {fam: None if sel.match_all else tuple(a for a in node.nodeport_addresses if family_of(a) == fam)
                      for fam, sel in ((IPV4, self._nodeport_selection[4]), (IPV6, self._nodeport_selection[6]))}
            if self.healthchecks.sync(dict(self._health_checks), listen):
                self._service_state_changed = True   # a port not bound: tried again next sync

    def _apply_config(self) -> None:
        with self._lock:
            cidrs = tuple(sorted({c for cs in self._service_cidrs.values() for c in cs}))
        local = self._node_pod_cidrs if self.config.detect_local_node_cidr else self.config.cluster_cidrs
        if self._src_ports is None:
            try:
                self._src_ports = masquerade_port_range(self.config.netns, self.config.node_port_range,
                                                        self.config.masquerade_ports)
            except (OSError, KxlbError) as exc:
                log.error("masquerade source ports: %s; using the datapath's default range", exc)
                self._src_ports = ()
        want = datapath_config((self._node_ip, self._node_ip6), self.config.masquerade_address, local, cidrs,
                               self.config.masquerade_all, self._src_ports or None,
                               self._node_external - (self._local_addrs or frozenset()))
        if want == self._dp_config:
            return
        try:
            self.programmer.table.set_config(want)
        except KxlbError as exc:
            # A value the maps cannot take (service CIDRs past the config's own four with no
            # room for them, a bad setting): the services are programmed all the same, and
            # the config is tried again next sync.
            log.error("datapath config: %s", exc)
            self._dp_config = None
            return
        self._dp_config = want
        log.info("datapath: masquerade to %s (hairpin%s%s); service CIDRs %s",
                 " and ".join(want.snat_addrs) or "(nothing: no address known)",
                 f", clients outside {' and '.join(want.cluster_cidrs)}" if want.cluster_cidrs else "",
                 ", all cluster IP traffic" if want.masquerade_all else "", ", ".join(cidrs) or "(none known)")
        if want.src_ports:
            log.info("datapath: masqueraded flows use source ports %d-%d (outside ip_local_port_range and the NodePort "
                     "range)", *want.src_ports)

    def reconcile(self) -> None:
        """A full sync from the caches, then repair of what was changed in the maps
        behind our back (the first sync's read of the maps is that repair)."""
        just_read = not self.programmer.table.loaded  # the sync starts by reading the maps
        self.sync(full=True)
        repaired = self.programmer.reconcile(just_read)
        if repaired:
            self.metrics.drift_repaired.inc(len(repaired))
        self._count_map_entries()

    def _count_map_entries(self) -> None:
        """The map-entry gauges, once a drift cycle (conntrack's count is a read of it)."""
        cur = self.programmer.current
        v6 = sum(1 for k in cur if ":" in k.vip)
        for fam, n in ((V4, len(cur) - v6), (V6, v6)):
            self.metrics.map_entries.labels("services" + fam.suffix).set(n)
            self.metrics.map_entries.labels("backends" + fam.suffix).set(self.programmer.table.slots_used_by(fam))
            self.metrics.map_entries.labels("conntrack" + fam.suffix).set(fam.map(self.maps, "conntrack").items_raw()[2])


class SyncIncomplete(Exception):
    """The kernel refused some map writes: the runner retries (a full sync) with backoff."""
