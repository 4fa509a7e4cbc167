"""Controller at scale against the real API server: N Services x 10 endpoints (default
20,000), then EndpointSlice churn (default 100 updates/s for 60 s).

Reports: the time from the controller's start to every service programmed (list from
the API server included), write-to-maps latency p50/p99 of the churn (from the slice
write's start to the new endpoint in the pinned maps), the controller's CPU (cores used
during the churn) and its RSS. Run it with `make bench-scale` (about 10 minutes; root).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
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


def run(n: int, rate: float, seconds: float) -> dict:
    from controller import BenchCluster, _rss_mb, pct
    from kubernetes import client

    from kxlb.loader.layout import ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    with BenchCluster("/tmp/kxlb-bench-churn-cp", 600, "kxlb-apichn0", "10.254.0.6") as bc:
        c, api = bc.c, bc.api
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
        keys: list[ServiceKey] = [None] * n  # type: ignore[list-item]

        def make(i: int) -> None:
            svc = c.make_service(api, NS, f"s{i}", [PORT], endpoints(i, 0), slice_ports=[("http", 8080, "TCP")])
            keys[i] = ServiceKey(svc["spec"]["clusterIP"], 80, 6)

        with ThreadPoolExecutor(8) as pool:
            list(tqdm(pool.map(make, range(n)), total=n, desc=f"creating {n} Services + slices", unit="svc"))

        t0 = time.monotonic()
        ctl = bc.controller(wait_ready=False)
        while time.monotonic() - t0 < 600 and ctl.metric("kxlb_services_programmed") < n:
            time.sleep(0.1)
        initial = time.monotonic() - t0
        table = ServiceTable(Maps.open(bc.lab.pin_dir))

        # Churn: `rate` slice replacements a second; a poller times each one to the maps.
        pending: dict[int, tuple[float, str]] = {}
        written: dict[int, float] = {}   # when the API server answered the write
        lat: list[float] = []
        lat_after: list[float] = []
        lock = threading.Lock()
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set() or pending:
                with lock:
                    items = list(pending.items())
                for i, (t_start, want) in items:
                    got = table.read_backends(keys[i]) or ()
                    if any(b.addr == want for b in got):
                        now = time.monotonic()
                        with lock:
                            pending.pop(i, None)
                            t_written = written.pop(i, None)
                        lat.append(now - t_start)
                        if t_written is not None:
                            lat_after.append(max(0.0, now - t_written))
                time.sleep(0.001)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        cpu0, w0 = cpu_seconds(ctl.proc.pid), time.monotonic()
        rnd, gen = random.Random(1), 0
        with ThreadPoolExecutor(8) as pool:
            end = time.monotonic() + seconds
            for k in tqdm(range(int(rate * seconds)), desc=f"churn {rate:g}/s", unit="upd"):
                due = w0 + k / rate
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
                i = rnd.randrange(n)
                gen += 1
                eps = endpoints(i, gen)

                def write(i=i, eps=eps) -> None:
                    with lock:
                        pending[i] = (time.monotonic(), eps[-1][0])
                        written.pop(i, None)
                    c.put_slice(api, NS, f"s{i}", eps, [("http", 8080, "TCP")])
                    with lock:
                        if i in pending:
                            written[i] = time.monotonic()
                pool.submit(write)
            achieved = int(rate * seconds) / max(time.monotonic() - w0, 1e-9)
        stop.set()
        poller.join(30)
        cpu = (cpu_seconds(ctl.proc.pid) - cpu0) / (time.monotonic() - w0)
        return {"services": n, "initial_s": initial, "updates": len(lat), "rate": achieved,
                "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000,
                "after_p50_ms": pct(lat_after, 50) * 1000 if lat_after else float("nan"),
                "after_p99_ms": pct(lat_after, 99) * 1000 if lat_after else float("nan"), "cpu_cores": cpu,
                "rss_mb": _rss_mb(ctl.proc.pid), "lost": len(pending)}

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=20000)
    ap.add_argument("--rate", type=float, default=100, help="EndpointSlice updates a second")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the control plane and lab are cleaned up
    r = run(a.services, a.rate, a.seconds)
    print("\n| services x 10 endpoints | start to all programmed s | churn updates/s | write start to maps p50 / p99 ms "
          "| write response to maps p50 / p99 ms | controller CPU cores | controller RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['services']:,} | {r['initial_s']:.1f} | {r['rate']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | "
          f"{r['after_p50_ms']:.1f} / {r['after_p99_ms']:.1f} | {r['cpu_cores']:.2f} | {r['rss_mb']:.0f} |")
    if r["lost"]:
        print(f"\n{r['lost']} updates never reached the maps")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
