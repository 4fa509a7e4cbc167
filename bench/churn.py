"""Controller at scale against the real API server: N Services x 10 endpoints (default
20,000), then EndpointSlice churn (default 100 updates/s for 60 s).

Reports: the time from the controller's start to ready (every service programmed, list from
the API server included), write-to-maps latency p50/p99 of the churn (from the slice
write's start, and from the API server's answer, to the new endpoint in the pinned maps),
split where an independent watcher sees the change (API server and etcd before it, the
controller after it), the controller's CPU (cores used during the churn) and its RSS.
The controller runs with a node's default periods (reconcile 30 s, full resync 1 h);
`--full-sync-period 20` makes the full resync fall inside the churn (at 180 times its
hourly pace), which measures what changes wait behind it.
Run it with `make bench-scale` (about 10 minutes; root).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "controller"))
sys.path.insert(0, str(ROOT / "bench"))

NS = "churn"
PORT = ("http", 80, "TCP")


def endpoints(i: int, gen: int) -> list[tuple[str, dict]]:
    """Ten addresses for service i; generation ``gen`` changes the last one."""
    import conftest as c

    base = [f"10.{128 + i // 6500}.{(i // 25) % 256}.{(i % 25) * 10 + j}" for j in range(9)]
    return [(ip, c.READY) for ip in base + [f"10.{192 + gen % 60}.{i // 256 % 256}.{i % 256}"]]


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- observers in their own processes ---------------------------------------------------------
# The bench process runs 8 writer threads on the (CPU-hungry) Python client; an observer
# thread beside them would wait for the GIL and see everything late. So the two clocks
# that split the latency run in spawned processes of their own: one watches the
# EndpointSlices as any client of the API server would (when the API server delivered a
# change), one polls the pinned maps (when the datapath had it). Both stamp
# time.monotonic(), which is one clock for every process of the machine.

def watch_slices(kubeconfig: str, out, stop) -> None:
    """Report (name, last endpoint address, time) for every slice change in NS."""
    from kubernetes import client, config, watch

    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    disc = client.DiscoveryV1Api(client.ApiClient(cfg))
    rv = disc.list_namespaced_endpoint_slice(NS, limit=1).metadata.resource_version
    out.put(("ready", None, 0.0))
    while not stop.is_set():
        w = watch.Watch()
        for ev in w.stream(disc.list_namespaced_endpoint_slice, NS, resource_version=rv, timeout_seconds=5,
                           _preload_content=False, allow_watch_bookmarks=False):
            t = time.monotonic()
            o = ev["raw_object"]
            rv = o["metadata"]["resourceVersion"]
            if ev["type"] == "MODIFIED":
                out.put((o["metadata"]["name"], o["endpoints"][-1]["addresses"][0], t))
            if stop.is_set():
                break


def probe_maps(pin_dir: str, keys: list, todo, out, stop) -> None:
    """For every (i, address) received, report when service i's backends in the pinned
    maps include the address."""
    import queue

    from kxlb.loader.layout import ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    table = ServiceTable(Maps.open(pin_dir))
    pending: dict[int, str] = {}
    out.put(("ready", None, 0.0))
    while not (stop.is_set() and not pending):
        try:
            while True:
                i, want = todo.get(timeout=0.001 if pending else 0.05)
                pending[i] = want
        except queue.Empty:
            pass
        for i, want in list(pending.items()):
            if any(b.addr == want for b in table.read_backends(ServiceKey(*keys[i])) or ()):
                out.put((i, want, time.monotonic()))
                del pending[i]


def _drain(q) -> list:
    import queue

    got = []
    while True:
        try:
            got.append(q.get(timeout=0.5))
        except queue.Empty:
            return got


def run(n: int, rate: float, seconds: float, full_sync_period: float | None = None) -> dict:
    import multiprocessing as mp

    from controller import BenchCluster
    from stats import pct, rss_mb
    from kubernetes import client

    from kxlb.loader.layout import ServiceKey

    with BenchCluster("/tmp/kxlb-bench-churn-cp", 600, "kxlb-apichn0", "10.254.0.6") as bc:
        c, api = bc.c, bc.api
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
        keys: list[ServiceKey] = [None] * n  # type: ignore[list-item]

        def make(i: int) -> None:
            svc = c.make_service(api, NS, f"s{i}", [PORT], endpoints(i, 0), slice_ports=[("http", 8080, "TCP")])
            keys[i] = ServiceKey(svc["spec"]["clusterIP"], 80, 6)

        with ThreadPoolExecutor(8) as pool:
            list(tqdm(pool.map(make, range(n)), total=n, desc=f"creating {n} Services + slices", unit="svc"))

        # Ready (/readyz 200) is after the first sync's writes and its check of the maps:
        # the churn starts then, or its first updates measure the start-up.
        t0 = time.monotonic()
        periods = ["--full-sync-period", f"{full_sync_period:g}"] if full_sync_period else []
        ctl = bc.controller(wait_ready=False, extra=periods)
        ctl.wait_ready(timeout=600)
        initial = time.monotonic() - t0
        assert ctl.metric("kxlb_services_programmed") >= n, "ready before every service was programmed"

        ctx = mp.get_context("spawn")
        stop, todo, seen_watch, seen_maps = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=watch_slices, args=(str(bc.cp.admin_kubeconfig), seen_watch, stop), daemon=True),
                 ctx.Process(target=probe_maps, args=(bc.lab.pin_dir, [tuple(k) for k in keys], todo, seen_maps, stop),
                             daemon=True)]
        for p in procs:
            p.start()
        for q in (seen_watch, seen_maps):
            assert q.get(timeout=120)[0] == "ready", "an observer process failed to start"

        # Churn: `rate` slice replacements a second, each timed at its start and at the
        # API server's answer; the observers time it in the watch and in the maps.
        started: dict[tuple[int, str], float] = {}
        answered: dict[tuple[int, str], float] = {}
        cpu0, w0 = cpu_seconds(ctl.proc.pid), time.monotonic()
        rnd, gen = random.Random(1), 0
        with ThreadPoolExecutor(8) as pool:
            for k in tqdm(range(int(rate * seconds)), desc=f"churn {rate:g}/s", unit="upd"):
                due = w0 + k / rate
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
                i = rnd.randrange(n)
                gen += 1
                eps = endpoints(i, gen)

                def write(i=i, eps=eps) -> None:
                    started[(i, eps[-1][0])] = time.monotonic()
                    todo.put((i, eps[-1][0]))
                    c.put_slice(api, NS, f"s{i}", eps, [("http", 8080, "TCP")])
                    answered[(i, eps[-1][0])] = time.monotonic()
                pool.submit(write)
            achieved = int(rate * seconds) / max(time.monotonic() - w0, 1e-9)
        cpu = (cpu_seconds(ctl.proc.pid) - cpu0) / (time.monotonic() - w0)
        rss = rss_mb(ctl.proc.pid)
        # What the controller's own clock says of its full syncs and drift check shares.
        runs = {what: (ctl.metric(f"{name}_count"), ctl.metric(f"{name}_sum"))
                for what, name in (("full", "kxlb_sync_full_proxy_rules_duration_seconds"),
                                   ("drift", "kxlb_drift_check_duration_seconds"))}
        time.sleep(5)   # the last updates reach the maps
        stop.set()
        watched = {(int(name[1:].split("-")[0]), addr): t for name, addr, t in _drain(seen_watch)}
        mapped = {(i, addr): t for i, addr, t in _drain(seen_maps)}
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        # An update overtaken by a newer one to the same service before the maps showed
        # it is not timed (the prober follows the newest address of a service).
        both = [u for u in started if u in mapped and u in answered]
        split = [u for u in both if u in watched]

        def ms(xs: list[float], p: float) -> float:
            return pct(xs, p) * 1000 if xs else float("nan")
        lat = [mapped[u] - started[u] for u in both]
        after = [max(0.0, mapped[u] - answered[u]) for u in both]
        # Split at the observer's watch event, not at the write's answer: the writer threads
        # wait for the GIL, so an answer is stamped late (the event often precedes it).
        api_delay = [watched[u] - started[u] for u in split]
        ctl_delay = [max(0.0, mapped[u] - watched[u]) for u in split]
        return {"services": n, "full_sync_period_s": full_sync_period, "initial_s": initial, "updates": len(both), "rate": achieved,
                "p50_ms": ms(lat, 50), "p99_ms": ms(lat, 99), "max_ms": ms(lat, 100), "after_p50_ms": ms(after, 50), "after_p99_ms": ms(after, 99),
                "watch_p50_ms": ms(api_delay, 50), "watch_p99_ms": ms(api_delay, 99),
                "ctl_p50_ms": ms(ctl_delay, 50), "ctl_p99_ms": ms(ctl_delay, 99),
                "cpu_cores": cpu, "rss_mb": rss, "lost": len(started) - len(mapped),
                "full_syncs": runs["full"][0], "full_sync_mean_ms": 1000 * runs["full"][1] / max(runs["full"][0], 1),
                "drift_shares": runs["drift"][0],
                "drift_share_mean_ms": 1000 * runs["drift"][1] / max(runs["drift"][0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=20000)
    ap.add_argument("--rate", type=float, default=100, help="EndpointSlice updates a second")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--full-sync-period", type=float,
                    help="the controller's --full-sync-period (default: a node's, 1 h)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the control plane and lab are cleaned up
    r = run(a.services, a.rate, a.seconds, a.full_sync_period)
    print("\n| services x 10 endpoints | full resync every | start to ready s | churn updates/s | write start to maps p50 / p99 ms "
          "| write response to maps p50 / p99 ms | write start to watch event p50 / p99 ms | watch event to maps p50 / p99 ms "
          "| controller CPU cores | controller RSS MB | max ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    full = f"{r['full_sync_period_s']:g} s" if r["full_sync_period_s"] else "1 h"
    print(f"| {r['services']:,} | {full} | {r['initial_s']:.1f} | {r['rate']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | "
          f"{r['after_p50_ms']:.1f} / {r['after_p99_ms']:.1f} | {r['watch_p50_ms']:.1f} / {r['watch_p99_ms']:.1f} | "
          f"{r['ctl_p50_ms']:.1f} / {r['ctl_p99_ms']:.1f} | {r['cpu_cores']:.2f} | {r['rss_mb']:.0f} | {r['max_ms']:.0f} |")
    print(f"\nthe controller's full syncs: {r['full_syncs']:.0f}, {r['full_sync_mean_ms']:.0f} ms each on average "
          f"(the first included); drift check shares: {r['drift_shares']:.0f}, {r['drift_share_mean_ms']:.2f} ms each")
    if r["lost"]:
        print(f"\n{r['lost']} updates not seen in the maps (overtaken by a newer one to the same service, or lost)")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
