"""kxlb against the real kube-proxy (iptables and nftables) on the same lab, one run.

For each number of Services (N: 1, 1k, 10k by default; 30k with --sizes), with N Services
of 10 endpoints each present, and for each proxy in turn on every node of the lab
(`lab/proxies.py` PROXY_MODES: none, kube-proxy-iptables (the host's iptables, nf_tables
backend), kube-proxy-iptables-legacy (x_tables backend), kube-proxy (nftables), kxlb (tc),
kxlb-xdp), this measures:

- **sync**: from the proxy's start to the newest Service answering from outside (the
  proxy lists N Services and programs them all);
- **new-connection latency** p50/p99 (connect, one request, its reply) from a pod and
  from the outside client to that Service, over several rounds (the spread is the
  range of the rounds' p50s);
- **create to answering** and **change to answering**: with N present, a new Service
  (and its EndpointSlice) created, then its port changed, until the new port answers;
- **memory**: the proxies' RSS (both nodes) plus what the kernel holds for their state
  (SUnreclaim + VmallocUsed of /proc/meminfo, before the start and after the sync:
  rules, sets, BPF maps);
- at the first N only: **throughput** of one TCP stream through the Service (iperf3,
  client and server pinned to one core), packets per second, and CPU time per packet
  (every core's busy time over the packets through the client's interface).

Before each proxy (the floor included) the bench waits for the lab's own processes to go
quiet (`settle`): the control plane goes on working for a while after N Services are
created, and whichever proxy came first paid for it. Untimed connections then warm the
path (neighbour entries, caches) the same for every proxy. The floor is the same traffic with no proxy, straight to the pod addresses (the client
gets a route to the pods for it); every figure with a floor is reported as a ratio to
it. Results go to docs/bench-e2e/ (results.json, plots) and the table to
docs/bench-e2e.md and README's benchmark section. Run with `make bench-e2e` (root).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from e2e_report import kept_results, label, render, write_docs  # noqa: E402
from stats import rss_mb  # noqa: E402

from kxlb.lab import kube, procs  # noqa: E402
from kxlb.lab.client import tcp_exchange  # noqa: E402
from kxlb.lab.cluster import MARKER_ENV, Lab, LabError  # noqa: E402
from kxlb.lab.proxies import PROXY_MODES  # noqa: E402
from kxlb.lab.nodes import CLUSTER_CIDR, run  # noqa: E402
from kxlb.loader.netns import netns  # noqa: E402

WORKDIR = Path("/tmp/kxlb-bench-e2e")
LAB_NAME, PORT_OFFSET = "kxbe", 4000        # its own lab: never a developer's or the tests'
NS, BG_NS = "bench-e2e", "bench-e2e-bg"
ENDPOINTS = 10                              # pods behind every Service
ECHO_PORT, VIP_PORT, IPERF_PORT = 8080, 80, 5201
DEFAULT_PROXIES = ("none", "kube-proxy-iptables", "kube-proxy-iptables-legacy", "kube-proxy", "kxlb", "kxlb-xdp")
MANAGED_BY = "bench-e2e.kxlb.io"


# --- traffic ---------------------------------------------------------------------------------------
def request_seconds(ns: str, addr: str, port: int, timeout: float = 3.0, line: bool = True) -> float:
    """One new TCP connection from namespace ``ns``: connect, a line and its reply
    (``line``; without, the connect alone, for a server that must not be sent one:
    iperf3 -s), close. The socket is made before the clock starts (entering the
    namespace is not traffic)."""
    with netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with s:
        s.settimeout(timeout)
        t0 = time.perf_counter()
        s.connect((addr, port))
        if line:
            tcp_exchange(s, "x")
        return time.perf_counter() - t0


def connect_seconds(ns: str, addr: str, port: int, timeout: float = 3.0) -> float:
    return request_seconds(ns, addr, port, timeout, line=False)


def wait_answer(ns: str, addr: str, port: int, timeout: float, probe=request_seconds) -> float:
    """Try new connections (``probe``) until one succeeds; returns time.monotonic() then."""
    end = time.monotonic() + timeout
    while True:
        try:
            probe(ns, addr, port, timeout=0.02)
            return time.monotonic()
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"{addr}:{port} not answering from {ns} after {timeout:.0f}s") from None
            time.sleep(0.002)


def answered_ms(ns: str, addr: str, port: int, t0: float, timeout: float) -> float:
    """Milliseconds from *t0* until a new connection to addr:port is answered."""
    return (wait_answer(ns, addr, port, timeout) - t0) * 1000


def latencies(ns: str, targets: list[tuple[str, int]], n: int, desc: str) -> tuple[list[float], int]:
    """``n`` new connections, round-robin over ``targets`` (a VIP, or the pods themselves
    for the floor, so the floor spreads over the same pods as a Service does). Returns
    the answered ones' seconds and how many failed (refused, reset, 3 s without answer)."""
    got, failed = [], 0
    for i in tqdm(range(n), desc=desc, unit="conn", leave=False):
        try:
            got.append(request_seconds(ns, *targets[i % len(targets)]))
        except OSError:
            failed += 1
    return got, failed


# --- the lab's objects -------------------------------------------------------------------------------
def _slice(name: str, eps: list[tuple[str, str]], port: int) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": name,
                                                  "endpointslice.kubernetes.io/managed-by": MANAGED_BY}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                           "nodeName": node} for ip, node in eps],
            "ports": [{"name": "tcp", "port": port, "protocol": "TCP"}]}


def create_service(api, ns: str, name: str, eps: list[tuple[str, str]], port: int = VIP_PORT,
                   target: int = ECHO_PORT) -> str:
    """A selector-less Service and its EndpointSlice (so the endpoints are there as soon
    as the Service is, whatever the endpoint controller's pace); returns the cluster IP."""
    from kubernetes import client

    core, disc = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"ports": [{"name": "tcp", "port": port, "targetPort": target, "protocol": "TCP"}]}}
    svc = json.loads(core.create_namespaced_service(ns, body, _preload_content=False).data)
    disc.create_namespaced_endpoint_slice(ns, _slice(name, eps, target), _preload_content=False)
    return svc["spec"]["clusterIP"]


def grow_background(b: "Bench", want: int) -> None:
    """Make BG_NS hold Services bg-0 .. bg-(want-1) (what exists is kept: a kept lab
    (--keep) resumes), each with the echo pods as its 10 endpoints."""
    from kubernetes import client

    api = b.api
    core = client.CoreV1Api(api)
    have, cont = set(), None
    while True:
        page = json.loads(core.list_namespaced_service(BG_NS, limit=5000, _continue=cont,
                                                       _preload_content=False).data)
        have |= {o["metadata"]["name"] for o in page["items"]}
        cont = page["metadata"].get("continue")
        if not cont:
            break
    extra = [n for n in have if int(n.removeprefix("bg-")) >= want]  # a kept lab's larger run
    if extra:
        with ThreadPoolExecutor(8) as pool:
            list(tqdm(pool.map(lambda n: delete_service(api, BG_NS, n), extra), total=len(extra),
                      desc=f"deleting Services down to {want:,}", unit="svc"))
    todo = [i for i in range(want) if f"bg-{i}" not in have]
    if not todo:
        return
    def make(i: int) -> None:
        try:
            create_service(api, BG_NS, f"bg-{i}", b.pods)
        except client.ApiException as exc:
            if exc.status != 409:  # a half-made one of an earlier run
                raise
    with ThreadPoolExecutor(8) as pool:
        list(tqdm(pool.map(make, todo), total=len(todo), desc=f"creating Services up to {want:,}", unit="svc"))


@dataclass
class Bench:
    """What the run measures with: the lab, the echo pods, the probe pod."""
    lab: Lab
    api: object
    pods: list[tuple[str, str]] = field(default_factory=list)  # (pod IP, node), sorted by name
    probe_ns: str = ""
    iperf_pod: tuple[str, str, str] = ("", "", "")           # (pod IP, its netns, its node)
    iperf_vip: str = ""

    @property
    def client_ns(self) -> str:
        return self.lab.client_ns


def bring_up() -> Bench:
    lab = Lab(WORKDIR, name=LAB_NAME, nodes=2, proxy="none", port_offset=PORT_OFFSET,
              log=lambda m: tqdm.write(f"lab: {m}"))
    lab.up()
    api = lab.api_client()
    for ns in (NS, BG_NS):
        try:
            kube.create_namespace(api, ns)
        except Exception as exc:  # noqa: BLE001 - already there in a kept lab
            if "AlreadyExists" not in str(exc):
                raise
    from kubernetes import client
    try:
        kube.create_deployment(api, NS, "echo", ENDPOINTS)
        node1 = lab.node(1).name
        kube.create_pod(api, NS, "probe", node_name=node1, ports=[])
        kube.create_pod(api, NS, "iperf", node_name=node1, ports=[])
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    pods = kube.wait_pods_ready(api, NS, "app=echo", ENDPOINTS, timeout=180)
    kube.wait_pods_ready(api, NS, "app=probe", 1, timeout=120)
    iperf = kube.wait_pods_ready(api, NS, "app=iperf", 1, timeout=120)[0]
    b = Bench(lab, api, [(p["status"]["podIP"], p["spec"]["nodeName"]) for p in pods],
              lab.resolve_target(f"{NS}/probe")[0],
              (iperf["status"]["podIP"], lab.resolve_target(f"{NS}/iperf")[0], iperf["spec"]["nodeName"]))
    # The floor from outside goes to the pods themselves: the client reaches the pod
    # CIDR through node 1, as it reaches the service CIDR (inside the lab's fabric).
    run("ip", "-n", lab.client_ns, "route", "replace", CLUSTER_CIDR, "via", lab.node(1).ip)
    return b


# --- measurements -----------------------------------------------------------------------------------
def compile_seconds(lab: Lab) -> float | None:
    """The slower node's BCC compile, from the controllers' logs (their last start)."""
    found = []
    for n in lab.node_specs:
        log = lab.workdir / "logs" / f"kxlb-controller-{n.name}.log"
        hits = re.findall(r"datapath compiled and pinned in ([0-9.]+)s", log.read_text(errors="replace"))
        if hits:
            found.append(float(hits[-1]))
    return max(found) if found else None


def kernel_kb() -> int:
    """Kernel memory a proxy's state can live in: unreclaimable slab (nftables and
    iptables rules, sets, conntrack) and vmalloc (large BPF maps, x_tables blobs)."""
    info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in open("/proc/meminfo"))}
    return info["SUnreclaim"] + info["VmallocUsed"]


def cpu_busy_seconds() -> float:
    """Busy time of every core so far (user, nice, system, irq, softirq, steal)."""
    f = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def link_packets(ns: str, dev: str = "eth0") -> int:
    links = json.loads(run("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)
    st = links[0]["stats64"]
    return st["rx"]["packets"] + st["tx"]["packets"]


def throughput(b: Bench, addr: str, port: int, seconds: float) -> dict:
    """One TCP stream from the client to the iperf pod through ``addr``: client and
    server on the same single core, so the figure is what one core moves."""
    cpu = str(os.cpu_count() - 1)
    srv = subprocess.Popen(["ip", "netns", "exec", b.iperf_pod[1], "taskset", "-c", cpu, "iperf3", "-s",
                            "-p", str(IPERF_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Listening, and reachable through ``addr`` (a connect alone: iperf3 -s drops it).
        wait_answer(b.client_ns, addr, port, 60, probe=connect_seconds)
        p0, c0 = link_packets(b.client_ns), cpu_busy_seconds()
        out = subprocess.run(["ip", "netns", "exec", b.client_ns, "taskset", "-c", cpu, "iperf3", "-c", addr,
                              "-p", str(port), "-t", str(seconds), "-J"], capture_output=True, text=True,
                             timeout=seconds + 30)
        p1, c1 = link_packets(b.client_ns), cpu_busy_seconds()
        res = json.loads(out.stdout)
        if "error" in res:
            raise RuntimeError(f"iperf3 to {addr}:{port}: {res['error']}")
        end = res["end"]
        dur = end["sum_received"]["seconds"]
        packets = p1 - p0
        return {"gbit_s": end["sum_received"]["bits_per_second"] / 1e9, "kpps": packets / dur / 1e3,
                "cpu_us_per_packet": (c1 - c0) / packets * 1e6}
    finally:
        srv.kill()
        srv.wait()


@dataclass
class Row:
    """One proxy at one size."""
    proxy: str
    services: int
    sync_s: float | None = None
    compile_s: float | None = None                          # kxlb: of sync_s, the BCC compile (slower node)
    client_ms: list[float] = field(default_factory=list)    # every connection's latency
    pod_ms: list[float] = field(default_factory=list)
    client_round_p50: list[float] = field(default_factory=list)
    pod_round_p50: list[float] = field(default_factory=list)
    client_failed: int = 0
    pod_failed: int = 0
    create_ms: list[float] = field(default_factory=list)
    change_ms: list[float] = field(default_factory=list)
    change_timeouts: int = 0                                # creations or changes not answering in time
    rss_mb: float = 0.0
    kernel_mb: float = 0.0
    throughput: dict | None = None


def measure(b: Bench, proxy: str, size: int, vip: str, a: argparse.Namespace, first_size: bool) -> Row:
    from statistics import median

    row = Row(proxy, size)
    b.lab.set_proxy("none")         # the last proxy's state is gone before the clock starts
    time.sleep(1.0)
    settle(b.lab, f"{proxy} @ {size:,}")
    k0 = kernel_kb()
    floor = proxy == "none"
    if not floor:
        t0 = time.monotonic()
        b.lab.set_proxy(proxy, timeout=a.sync_timeout)
        row.sync_s = wait_answer(b.client_ns, vip, VIP_PORT, a.sync_timeout) - t0
        row.compile_s = compile_seconds(b.lab) if PROXY_MODES[proxy].kind == "kxlb" else None
        time.sleep(2.0)  # the other node's proxy, a last write
        row.rss_mb = sum(rss_mb(pid) for pid in (b.lab.proxy_pid(n.name) for n in b.lab.node_specs) if pid)
        row.kernel_mb = max(0, kernel_kb() - k0) / 1024
    targets = [(ip, ECHO_PORT) for ip, _ in b.pods] if floor else [(vip, VIP_PORT)]
    for ns in (b.client_ns, b.probe_ns):  # untimed: neighbour entries and caches warm for every proxy alike
        latencies(ns, targets, 2 * len(b.pods), f"{proxy} @ {size:,}: warm-up")
    for r in range(a.rounds):
        for ns, all_ms, p50s, where in ((b.client_ns, row.client_ms, row.client_round_p50, "client"),
                                        (b.probe_ns, row.pod_ms, row.pod_round_p50, "pod")):
            secs, failed = latencies(ns, targets, a.connections, f"{proxy} @ {size:,}: from {where}, "
                                                                 f"round {r + 1}/{a.rounds}")
            setattr(row, f"{where}_failed", getattr(row, f"{where}_failed") + failed)
            all_ms += [x * 1000 for x in secs]
            if secs:
                p50s.append(median(secs) * 1000)
    if not floor:
        for k in range(a.changes):
            name = f"new-{uuid.uuid4().hex[:8]}"  # unique: a crashed run's leftovers are in the way of none
            try:
                t0 = time.monotonic()
                ip = create_service(b.api, NS, name, b.pods)
                row.create_ms.append(answered_ms(b.client_ns, ip, VIP_PORT, t0, a.change_timeout))
                t0 = time.monotonic()
                kube.patch_service(b.api, NS, name,
                                   [{"op": "replace", "path": "/spec/ports/0/port", "value": VIP_PORT + 1}])
                row.change_ms.append(answered_ms(b.client_ns, ip, VIP_PORT + 1, t0, a.change_timeout))
            except TimeoutError:
                # Part of the result (a proxy whose every sync takes longer), not a reason to drop the row.
                row.change_timeouts += 1
            finally:
                delete_service(b.api, NS, name)
    if first_size:
        row.throughput = throughput(b, b.iperf_pod[0] if floor else b.iperf_vip, IPERF_PORT, a.iperf_seconds)
    return row


def settle(lab: Lab, what: str, busy: float = 0.10, window: float = 2.0, timeout: float = 300) -> None:
    """Wait until the lab's own processes (control plane, pod agents, LB pool) use less
    than *busy* of a core over *window* seconds: after N Services are created the API
    server, etcd and the EndpointSlice controller go on working for a while, and a proxy
    measured then would pay for it (the first one measured, the floor, most of all)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = lab.controlplane.pids() + procs.marked_pids(MARKER_ENV, str(lab.workdir))
        c0 = procs.cpu_seconds(pids)
        time.sleep(window)
        used = (procs.cpu_seconds(pids) - c0) / window
        if used < busy:
            return
        if time.monotonic() > deadline:
            tqdm.write(f"{what}: the lab still uses {used:.2f} of a core after {timeout:.0f}s; measuring anyway")
            return


def delete_service(api, ns: str, name: str) -> None:
    """The Service and its slice (either may be gone already: a crashed run)."""
    from kubernetes import client

    for delete in (client.CoreV1Api(api).delete_namespaced_service,
                   client.DiscoveryV1Api(api).delete_namespaced_endpoint_slice):
        try:
            delete(name, ns)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def versions(lab: Lab) -> dict:
    kp = subprocess.run([str(lab.bin_dir / "kube-proxy"), "--version"], capture_output=True, text=True).stdout.strip()
    ipt = subprocess.run(["iptables", "-V"], capture_output=True, text=True).stdout.strip()
    nft = subprocess.run(["nft", "-v"], capture_output=True, text=True).stdout.strip()
    ip3 = subprocess.run(["iperf3", "-v"], capture_output=True, text=True).stdout.splitlines()[0]
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    return {"kube-proxy": kp, "iptables": ipt, "nftables": nft, "iperf3": ip3, "kxlb": git}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,1000,10000", help="numbers of Services, ascending (default %(default)s; "
                                                            "the full series adds 30000)")
    ap.add_argument("--proxies", default=",".join(DEFAULT_PROXIES),
                    help=f"comma-separated, from {', '.join(PROXY_MODES)} (default %(default)s)")
    ap.add_argument("--connections", type=int, default=200, help="new connections per round and origin")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of connections (their p50s give the spread)")
    ap.add_argument("--changes", type=int, default=3, help="Services created and changed per proxy and size")
    ap.add_argument("--iperf-seconds", type=float, default=5)
    ap.add_argument("--sync-timeout", type=float, default=1800, help="seconds a proxy may take to program N")
    ap.add_argument("--change-timeout", type=float, default=60,
                    help="seconds a created or changed Service may take to answer (counted when exceeded)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench-e2e"), help="results.json and plots")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/bench-e2e.md and README's table")
    ap.add_argument("--keep", action="store_true", help="leave the lab (and its Services) up for a next run")
    ap.add_argument("--merge", action="store_true",
                    help="keep the saved rows of sizes this run does not measure (and the notes about proxies "
                         "and sizes it does not), so a long series can be run in parts; each size's rows still "
                         "come from one run")
    a = ap.parse_args()
    sizes = sorted({int(x) for x in a.sizes.split(",")})
    proxies = [p for p in a.proxies.split(",") if p]
    bad = [p for p in proxies if p not in PROXY_MODES]
    if bad or not sizes or sizes[0] < 1:
        ap.error(f"unknown proxy {', '.join(bad)}" if bad else "sizes must be 1 or more")
    if "none" not in proxies:
        proxies.insert(0, "none")  # the floor every ratio needs
    if os.geteuid() != 0:
        sys.exit("bench-e2e needs root (the lab)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b = bring_up()
    rows: list[Row] = []
    notes: list[str] = []
    kept_rows, kept_notes = (kept_results(json.loads((out / "results.json").read_text()), sizes, proxies)
                             if a.merge and (out / "results.json").exists() else ([], []))
    try:
        b.iperf_vip = create_or_read(b, "iperf", [(b.iperf_pod[0], b.iperf_pod[2])], IPERF_PORT, IPERF_PORT)
        for size in sizes:
            b.lab.set_proxy("none")  # the last size's last proxy would follow (and slow) every creation
            grow_background(b, size - 1)
            vip = create_or_read(b, f"last-{size}", b.pods, VIP_PORT, ECHO_PORT)
            for proxy in tqdm(proxies, desc=f"{size:,} Services", unit="proxy"):
                try:
                    row = measure(b, proxy, size, vip, a, size == sizes[0])
                except (TimeoutError, LabError) as exc:  # a proxy that cannot program N in time: said, not fatal
                    b.lab.set_proxy("none")  # now: its half-done sync (an iptables-restore) goes with it
                    why = str(exc).splitlines()[0]
                    notes.append(f"{label(proxy)} at {size:,} Services: {why} (--sync-timeout {a.sync_timeout:.0f}); "
                                 "no row")
                    tqdm.write(notes[-1])
                    continue
                rows.append(row)
                tqdm.write(render([asdict(r) for r in rows if r.services == size], compact=True).splitlines()[-1])
                (out / "results.json").write_text(json.dumps(
                    {"machine": machine(), "versions": versions(b.lab), "args": vars(a),
                     "rows": sorted(kept_rows + [asdict(r) for r in rows], key=lambda r: r["services"]),
                     "notes": kept_notes + notes}, indent=1))
    finally:
        b.lab.set_proxy("none")
        if not a.keep:
            b.lab.down()
        else:
            run("ip", "-n", b.lab.client_ns, "route", "del", CLUSTER_CIDR, check=False)
    results = json.loads((out / "results.json").read_text())
    print(render(results["rows"]))
    if not a.no_docs:
        write_docs(results, out, ROOT)


def create_or_read(b: Bench, name: str, eps: list[tuple[str, str]], port: int, target: int) -> str:
    from kubernetes import client

    try:
        return create_service(b.api, NS, name, eps, port, target)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        return kube.read_service(b.api, NS, name)["spec"]["clusterIP"]


if __name__ == "__main__":
    main()
