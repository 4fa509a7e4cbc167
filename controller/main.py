"""`kxlb controller`: watch the cluster and keep this node's datapath in sync."""
from __future__ import annotations

import datetime as dt
import faulthandler
import ipaddress
import json
import logging
import os
import signal
import threading
import time

from kxlb.loader.errors import KxlbError
from kxlb.loader.journal import Journal
from kxlb.loader.lock import LockBusy, WriterLock
from kxlb.loader.maglev import DEFAULT_TABLE_SIZE, check_table_size
from kxlb.loader.maps import Maps
from kxlb.loader.netns import netns, netns_path
from kxlb.loader.registry import Registry

# The servers, metrics and the model are imported by run(): registering the sub-command
# (every `kxlb` invocation does) must not cost their imports (prometheus_client, ...).

log = logging.getLogger("kxlb.controller")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def api_client(kubeconfig: str | None):
    from kubernetes import client as k8s, config

    if kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = k8s.Configuration()
        try:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        except Exception as exc:
            raise KxlbError(f"cannot load kubeconfig {kubeconfig or '~/.kube/config'}: {exc}") from None
    else:
        cfg = k8s.Configuration()
        config.load_incluster_config(client_configuration=cfg)
    return k8s.ApiClient(cfg)


DEFAULTS = {"min_sync_period": 0.0, "reconcile_period": 30.0, "full_sync_period": 3600.0, "metrics_bind_address": "127.0.0.1:10249",
            "healthz_bind_address": "0.0.0.0:10256", "masquerade_all": False, "nodeport_addresses": [],
            "node_name": None, "kubeconfig": None, "cluster_cidr": None, "detect_local": None,
            "conntrack_max_per_core": 32768, "conntrack_min": 131072}   # kube-proxy's conntrack defaults


# Settings a KubeProxyConfiguration holds -> its field (DEFAULTS' others are kxlb's own,
# or the node name, which a flag sets over the file as kube-proxy's --hostname-override).
FILE_FIELDS = {"min_sync_period": "the mode's minSyncPeriod", "reconcile_period": "the mode's syncPeriod",
               "metrics_bind_address": "metricsBindAddress", "healthz_bind_address": "healthzBindAddress",
               "masquerade_all": "masqueradeAll", "nodeport_addresses": "nodePortAddresses",
               "kubeconfig": "clientConnection.kubeconfig", "cluster_cidr": "clusterCIDR",
               "detect_local": "detectLocalMode", "conntrack_max_per_core": "conntrack.maxPerCore",
               "conntrack_min": "conntrack.min"}


def conntrack_flows(max_per_core: int, minimum: int, cpus: int | None = None) -> int:
    """kube-proxy's nf_conntrack_max: maxPerCore x CPUs, at least min (maxPerCore 0: min).
    kxlb sizes its own conntrack table with it (loader/mapspec.py conntrack_cflags)."""
    return max(max_per_core * (cpus or os.cpu_count() or 1), minimum)


def resolve(a) -> None:
    """Fill every setting of ``a`` from its flag, else --config, else DEFAULTS."""
    from .kpconfig import FileSettings, load, merged

    fs = load(a.config) if a.config else FileSettings()
    for name, default in DEFAULTS.items():
        flag = getattr(a, name)
        if a.config and flag is not None and name in FILE_FIELDS:
            # kube-proxy's rule: with --config, the file is the configuration and its
            # flags are ignored (but --hostname-override, kxlb's --node-name); said here,
            # where kube-proxy says nothing.
            log.warning("--%s is ignored with --config, as kube-proxy ignores its flags there: set %s in %s",
                        name.replace("_", "-"), FILE_FIELDS[name], a.config)
            flag = None
        setattr(a, name, merged(flag, getattr(fs, name), default))
    # kube-proxy's GetHostname: the override trimmed and lower-cased (Node names are)
    a.node_name = (a.node_name or "").strip().lower()
    if not a.node_name:
        raise KxlbError("--node-name is required (or hostnameOverride in --config)")


def run(a) -> None:
    from .attacher import InterfaceAttacher
    from .controller import Controller, ControllerConfig
    from .events import EventRecorder
    from .health import ProxyHealth, serve_health
    from .metrics import Metrics, serve
    from .node import one_cidr_per_family, parse_nodeport_addresses, parse_port_range

    setup_logging(a.log_level, a.log_format)
    if a.cleanup:
        cleanup(a)
        return
    resolve(a)
    check_table_size(a.maglev_table_size)  # before anything is attached or written
    from .node import masquerade_port_range, parse_port_range as _ports
    if a.masquerade_ports:  # refused before anything is attached (overlaps the NodePorts, say)
        masquerade_port_range(a.netns, _ports(a.service_node_port_range, "--service-node-port-range"),
                              _ports(a.masquerade_ports, "--masquerade-ports"))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` dumps every thread's stack
    # Listen before the slow start-up (the datapath compile takes tens of seconds on a busy
    # node): a liveness probe meanwhile gets /livez 200, not "connection refused" and a
    # restart. /readyz is 503 until the first sync; /healthz answers as ProxyHealth does
    # (503 until the Node is seen). The controller takes over this ProxyHealth below.
    metrics = Metrics()
    health = ProxyHealth(2 * a.reconcile_period)
    mhost, mport = bind_address(a.metrics_bind_address, "--metrics-bind-address")
    hhost, hport = bind_address(a.healthz_bind_address, "--healthz-bind-address")
    server = serve(metrics, mhost, mport, health=health)
    with netns(a.netns):  # the node's namespace: where load balancers probe the node
        hserver = serve_health(health, hhost, hport,
                               lambda path, code: (metrics.healthz if path == "healthz" else metrics.livez)
                               .labels(str(code)).inc())
    lock, reg = take_pin_dir(a, hhost, hport)
    attacher = None
    if a.iface or a.cgroup:
        from kxlb.loader.mapspec import conntrack_cflags
        flows = conntrack_flows(a.conntrack_max_per_core, a.conntrack_min)
        dp = prepare_datapath(a.pin_dir, reg, lock, conntrack_cflags(flows))
        if a.cgroup:
            from kxlb.loader.mounts import cgroup2_dir
            from kxlb.loader.socklb import attach_socket_lb
            cgroup = cgroup2_dir(a.cgroup)
            if cgroup != a.cgroup:
                log.info("--cgroup %s is a cgroup v1 hybrid layout: the socket hooks go on its v2 hierarchy, %s",
                         a.cgroup, cgroup)
                a.cgroup = cgroup
            attach_socket_lb(a.pin_dir, a.cgroup, a.netns)  # the pinned hooks, for the node's namespace only
            log.info("socket-level load balancing attached to cgroup %s", a.cgroup)
        if a.iface:
            attacher = InterfaceAttacher(dp, a.netns, a.iface, a.xdp_mode if a.xdp else None, a.pin_dir,
                                         xdp_trust_checksums=a.xdp_trust_checksums, registry=reg).start()
    maps = Maps.open(a.pin_dir)
    from kxlb.loader.svcids import SvcIds
    ids = SvcIds(a.pin_dir, reg, maps.svc_stats.max_entries)  # kept up to date for the CLI after us
    journal = Journal(reg)
    repaired = journal.repair(maps)  # what a writer killed half way left (loader/journal.py)
    if repaired is not None:
        log.warning("a writer was killed in the middle of a change; repaired: %s", repaired)
    client = api_client(a.kubeconfig)
    if a.detect_local == "NodeCIDR":
        log.info("detect-local: the Node's podCIDR (detectLocalMode NodeCIDR)")
    ctl = Controller(client, maps, ControllerConfig(node_name=a.node_name, min_sync_period=a.min_sync_period,
                                                    detect_local_node_cidr=a.detect_local == "NodeCIDR",
                                                    reconcile_period=a.reconcile_period,
                                                    full_sync_period=a.full_sync_period,
                                                    cluster_cidrs=one_cidr_per_family(a.cluster_cidr,
                                                                                      "--cluster-cidr"),
                                                    masquerade_address=a.masquerade_address,
                                                    masquerade_all=a.masquerade_all,
                                                    nodeport_addresses=parse_nodeport_addresses(a.nodeport_addresses),
                                                    netns=a.netns, maglev_table_size=a.maglev_table_size,
                                                    node_port_range=parse_port_range(
                                                        a.service_node_port_range, "--service-node-port-range"),
                                                    masquerade_ports=parse_port_range(
                                                        a.masquerade_ports, "--masquerade-ports")
                                                    if a.masquerade_ports else None),
                     metrics, EventRecorder(client, a.node_name), journal=journal, ids=ids)
    ctl.health = health  # the one the listeners answer from (nothing has read the controller's own yet)
    ctl.start()
    log.info("controller for node %s started; maps in %s; metrics on %s", a.node_name, a.pin_dir,
             a.metrics_bind_address)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    log.info("stopping (the datapath and its maps stay as they are)")
    ctl.stop()
    if attacher:
        attacher.stop()
    lock.release()  # the next writer (a new controller, say) may go on
    server.close()
    hserver.close()


def cleanup(a) -> None:
    """--cleanup, as kube-proxy's: remove what kxlb made on this node, and exit (without
    talking to the API server). Waits for a controller still stopping to let go."""
    from kxlb.loader.cleanup import cleanup as clean

    done = clean(a.pin_dir, a.netns, a.cgroup, wait=60)
    log.info("cleanup: %d attachments detached, %d pins removed from %s", len(done.detached),
             len(done.pins_removed), a.pin_dir)
    for note in done.notes:
        log.warning("cleanup: %s", note)


def take_pin_dir(a, hhost: str, hport: int):
    """The pin directory's writer lock, for the controller's whole life (loader/lock.py):
    a manual `kxlb service add` beside it is refused at once, naming it, and a new
    controller (a DaemonSet's next pod) waits here until the old one has gone."""
    from kxlb.loader.datapath import prepare_pin_dir, require_root

    if a.iface or a.cgroup:
        require_root("kxlb controller --iface/--cgroup")
        netns_path(a.netns)
        prepare_pin_dir(a.pin_dir)  # 0700 and root's, as `kxlb load` makes it
    elif not os.path.isdir(a.pin_dir):
        raise KxlbError(f"no datapath pinned at {a.pin_dir}: load it (`kxlb load`) or pass --iface/--cgroup")
    what = f"the controller of node {a.node_name}"
    probe = "127.0.0.1" if hhost in ("0.0.0.0", "::") else hhost
    health = "" if a.netns else f"http://{'[' + probe + ']' if ':' in probe else probe}:{hport}/healthz"
    lock = WriterLock(a.pin_dir)
    while True:
        try:
            lock.acquire(timeout=10, what=what, patient=True, health=health)
            break
        except LockBusy as exc:
            log.warning("waiting for the pin directory's writer lock: %s", exc)
    reg = Registry(a.pin_dir, create=True)
    lock.announce()  # a first start made the registry only now
    return lock, reg


PREPARE = """
import sys
from kxlb.loader import datapath
from kxlb.loader.errors import KxlbError
from kxlb.loader.lock import WriterLock
from kxlb.loader.registry import Registry
pin, cflags = sys.argv[1], sys.argv[2:]
try:
    with WriterLock(pin).acquire(), Registry(pin, create=True) as reg:  # the parent's lock, inherited
        done = datapath.prepare(pin, reg, cflags)
    for line in done.migrated:
        print(f"migrated {line}")
    if done.reattached:
        print(f"{len(done.reattached)} earlier attachments switched to this build")
except KxlbError as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
"""


def prepare_datapath(pin_dir: str, reg, lock, cflags: list[str]):
    """This build's datapath in the pin directory: the pinned programs when they are this
    build's (a restart: no compile), else compiled, migrated and switched in a short-lived
    child under this process's writer lock, so LLVM (about 150 MB) never stays in the
    controller's memory (loader/datapath.py)."""
    import subprocess
    import sys

    from kxlb.loader.compile import pinned_datapath
    from kxlb.loader.datapath import plan, reusable
    from kxlb.loader.mapspec import datapath_specs

    dp = reusable(pin_dir, reg, plan(pin_dir, datapath_specs(cflags)), cflags)
    if dp is not None:
        log.info("the pinned datapath is this build's: attached without compiling")
        return dp
    t0 = time.monotonic()
    env, fds = lock.child_env()
    r = subprocess.run([sys.executable, "-c", PREPARE, pin_dir, *cflags], capture_output=True, text=True, env=env,
                       pass_fds=fds)
    if r.returncode != 0:
        raise KxlbError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "compiling the datapath failed")
    log.info("datapath compiled and pinned in %.1fs", time.monotonic() - t0)
    for line in r.stdout.splitlines():
        log.info("%s", line)   # maps migrated (a new layout or size), attachments switched
    return pinned_datapath(pin_dir)


def bind_address(text: str, flag: str) -> tuple[str, int]:
    """IP:PORT or [IPV6]:PORT -> (ip, port), or one clear error naming the flag. An empty
    IP, 0.0.0.0 or :: is every address of both families (controller/httpserve.py)."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise KxlbError(f"{flag} {text!r}: expected IP:PORT or [IPV6]:PORT")
    try:
        return str(ipaddress.ip_address(host or "0.0.0.0")), int(port)
    except ValueError:
        raise KxlbError(f"{flag} {text!r}: {host!r} is not an IP address") from None


def register(sub) -> None:
    p = sub.add_parser("controller", help="watch Kubernetes and keep this node's datapath in sync",
                       description="Watch Services, EndpointSlices and this Node; keep the pinned maps exactly in "
                                   "sync. The datapath keeps working while this process is down or restarting.")
    p.add_argument("--config", metavar="FILE",
                   help="a KubeProxyConfiguration file (kube-proxy's ConfigMap from kubeadm or kind): its fields "
                        "kxlb implements are used; as kube-proxy, the flags of those settings are then ignored "
                        "(with a warning), --node-name aside")
    p.add_argument("--node-name", help="this node's name (as in the Node object; or hostnameOverride in --config)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config when run in a pod, "
                                        "else ~/.kube/config)")
    p.add_argument("--min-sync-period", type=float,
                   help=f"seconds between two syncs at least; changes meanwhile are coalesced (default "
                        f"{DEFAULTS['min_sync_period']})")
    p.add_argument("--reconcile-period", type=float,
                   help=f"seconds between two runs of the sync loop at most (kube-proxy's syncPeriod; also half "
                        f"the health timeout; default {DEFAULTS['reconcile_period']})")
    p.add_argument("--full-sync-period", type=float,
                   help=f"every map is checked for drift (and repaired) once in this many seconds, a share per "
                        f"sync (kube-proxy's FullSyncPeriod; default {DEFAULTS['full_sync_period']:g})")
    p.add_argument("--metrics-bind-address",
                   help=f"HOST:PORT for /metrics, /proxyMode, /healthz, /livez, /readyz (default "
                        f"{DEFAULTS['metrics_bind_address']})")
    p.add_argument("--healthz-bind-address",
                   help=f"HOST:PORT, in the node's network namespace (--netns), for kube-proxy's /healthz and "
                        f"/livez that load balancers probe (default {DEFAULTS['healthz_bind_address']})")
    p.add_argument("--netns", help="network namespace of the node's interfaces (name or /proc/PID/ns/net)")
    p.add_argument("--iface", action="append", metavar="GLOB",
                   help="attach the datapath to interfaces matching GLOB, now and as they appear (repeatable); "
                        "without it the datapath must be loaded already (`kxlb load`)")
    p.add_argument("--xdp", action="store_true", help="attach at XDP instead of tc ingress")
    p.add_argument("--xdp-mode", choices=("generic", "native"), default="generic")
    p.add_argument("--xdp-trust-checksums", action="store_true",
                   help="allow --xdp on virtual devices (veth): only if every sender on them finalises its "
                        "checksums (docs/datapath.md, Hooks and coexistence)")
    p.add_argument("--cgroup", help="cgroup v2 directory whose processes (host network) get socket-level "
                                    "service translation (connect/sendmsg/recvmsg hooks)")
    p.add_argument("--cluster-cidr", metavar="CIDR[,CIDR]",
                   help="the pods' CIDR, one per family on a dual-stack cluster (10.244.0.0/16,fd00:10:244::/56): "
                        "service traffic from outside it is masqueraded (as kube-proxy's --cluster-cidr); hairpin "
                        "traffic always is")
    p.add_argument("--masquerade-address", help="source address for masqueraded flows of its family (default: the "
                                                "Node's InternalIP of each family)")
    p.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade every new flow to a cluster IP (kube-proxy's --masquerade-all)")
    p.add_argument("--detect-local-mode", dest="detect_local", choices=("ClusterCIDR", "NodeCIDR"),
                   help="how pod traffic is told from outside traffic: --cluster-cidr (default) or the "
                        "Node's spec.podCIDR (kube-proxy's flag)")
    p.add_argument("--nodeport-addresses", action="append", metavar="primary|localhost|all|CIDR[,...]",
                   help="where NodePorts (and health check node ports) are served, as kube-proxy's flag: the "
                        "node's interface addresses inside these CIDRs; 'primary' is the Node's node IP of each "
                        "family (its first InternalIP, else ExternalIP), 'localhost' loopback (reached by the "
                        "node's own processes), 'all' every address; a family without a CIDR is served on every "
                        "address of it. Repeatable, mixed. Default: primary; with a --config of mode iptables, "
                        "ipvs or unset, what that kube-proxy did: all, and 127.0.0.0/8 unless "
                        "iptables.localhostNodePorts is false")
    p.add_argument("--maglev-table-size", type=int, default=DEFAULT_TABLE_SIZE, metavar="M",
                   help=f"entries of the Maglev lookup table of the largest backend sets (a prime above the "
                        f"largest set, at most 65521; smaller sets get 251 or 1021: docs/datapath.md; default "
                        f"{DEFAULT_TABLE_SIZE}). A new size applies to a set when it next changes")
    p.add_argument("--service-node-port-range", default="30000-32767", metavar="LO-HI",
                   help="the cluster's NodePort range (kube-apiserver's flag; default %(default)s): masquerade "
                        "ports stay out of it")
    p.add_argument("--masquerade-ports", metavar="LO-HI",
                   help="source ports of masqueraded flows (default: the largest part of 1024-65535 outside "
                        "net.ipv4.ip_local_port_range and the NodePort range); refused if it overlaps either")
    p.add_argument("--conntrack-max-per-core", type=int, metavar="N",
                   help=f"flows kxlb's conntrack holds per CPU (kube-proxy's flag: there nf_conntrack_max; here "
                        f"the size of kxlb's own table, preallocated; default "
                        f"{DEFAULTS['conntrack_max_per_core']}; 0: --conntrack-min alone)")
    p.add_argument("--conntrack-min", type=int, metavar="N",
                   help=f"flows kxlb's conntrack holds at least, whatever the CPUs (default "
                        f"{DEFAULTS['conntrack_min']}). A new size is migrated into, flows kept")
    p.add_argument("--cleanup", action="store_true",
                   help="remove every program, hook and pin kxlb made on this node (in --netns, --cgroup, "
                        "--pin-dir), then exit: kube-proxy's --cleanup, for going back to kube-proxy")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    p.set_defaults(func=run)
