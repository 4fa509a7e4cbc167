"""Controller benchmarks.

1. Full sync: from Service and EndpointSlice objects handed over one by one (each parsed
   from its JSON as a watch-list stream delivers it) to every map entry programmed, for
   1k and 10k services of 10 endpoints, in a process that only opens the pinned maps (as
   `kxlb controller` does when `kxlb load` attached the datapath); its RSS after the sync
   (the long-lived model) and its peak are reported too. Then the same again in a new Controller over
   the maps just written, as after a controller restart (it adopts them: nothing to write).
2. Event to datapath, against the real API server: p50/p99 from an EndpointSlice write
   to (a) the maps updated, (b) the first new connection answered by the new backend.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stats import pct, rss_mb

ROOT = Path(__file__).resolve().parent.parent


# --- 1. full sync ---------------------------------------------------------------------------
def lists(n_services: int, endpoints: int = 10) -> tuple[dict, dict]:
    svcs, slices = [], []
    for i in range(n_services):
        ns, name = f"ns{i % 100}", f"svc{i}"
        ip = f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"
        svcs.append({"metadata": {"namespace": ns, "name": name, "resourceVersion": str(i)},
                     "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                              "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
        slices.append({"metadata": {"namespace": ns, "name": f"{name}-abcde", "resourceVersion": str(i),
                                    "labels": {"kubernetes.io/service-name": name}},
                       "addressType": "IPv4",
                       "endpoints": [{"addresses": [f"10.{(i * endpoints + j) // 65536 % 64 + 128}."
                                                    f"{(i * endpoints + j) // 256 % 256}.{(i * endpoints + j) % 256}"],
                                      "conditions": {"ready": True, "serving": True, "terminating": False},
                                      "nodeName": "node-1"} for j in range(endpoints)],
                       "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
    return {"items": svcs, "metadata": {"resourceVersion": "1"}}, {"items": slices, "metadata": {"resourceVersion": "1"}}


CHILD = r"""
import gc, json, sys, time
from kxlb.controller.controller import Controller, ControllerConfig, settle_memory
from kxlb.loader.maps import Maps
pin, path = sys.argv[1], sys.argv[2]


def start() -> tuple[float, object, object]:
    # What the informers hand over: one event per object, each parsed from its own JSON
    # as a watch-list stream delivers it (the parse is not timed), then a full sync (a
    # new Controller adopts what the pinned maps hold, as after a restart).
    ctl = Controller(None, Maps.open(pin), ControllerConfig(node_name="node-1"))
    handlers = {"s": ctl.on_service, "e": ctl.on_slice}
    spent = 0.0
    with open(path) as f:
        for line in f:
            o = json.loads(line[1:])
            t0 = time.perf_counter()
            handlers[line[0]]("ADDED", o["metadata"]["namespace"] + "/" + o["metadata"]["name"], o)
            spent += time.perf_counter() - t0
    del o
    t0 = time.perf_counter()
    res = ctl.sync(full=True)
    return spent + time.perf_counter() - t0, res, ctl


def status(field: str) -> float:
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) / 1024


def drift_check(ctl) -> dict:
    # The hourly repair, two ways: 0.2's full resync (a full sync and a read of every map,
    # in one run: what changes waited behind), and today's drift check in the shares of a
    # cycle of runs 30 s apart over an hour (controller/sweep.py), the first share at the
    # cycle's start (it also takes the lists).
    from kxlb.controller.sweep import DriftSweep
    t0 = time.perf_counter()
    ctl.reconcile()
    full = time.perf_counter() - t0
    sweep, shares = DriftSweep(3600.0), []
    sweep.checked_all(0.0)
    for i in range(121):
        t0 = time.perf_counter()
        new, lo, hi = sweep.step(3600.0 + 30.0 * i)
        if new:
            ctl._sweep_keys = list(ctl.programmer.current)
            ctl._sweep_entries = ctl.programmer.table.frontend_snapshot()
            ctl._count_map_entries()
        assert not ctl.programmer.drift(DriftSweep.part(ctl._sweep_keys, lo, hi),
                                        DriftSweep.part(ctl._sweep_entries, lo, hi))
        shares.append(time.perf_counter() - t0)
    rest = sorted(shares[1:])
    return {"resync_s": full, "share_start_ms": shares[0] * 1000, "share_p50_ms": rest[len(rest) // 2] * 1000,
            "share_max_ms": rest[-1] * 1000, "cycle_s": sum(shares)}


cold, res, ctl = start()
# VmHWM, not ru_maxrss: after exec, ru_maxrss still carries the parent's peak.
hwm = status("VmHWM")
settle_memory(freeze=True)   # as the controller does after its first sync
steady = status("VmRSS")     # the long-lived model of every Service, as the controller keeps it
drift = drift_check(ctl)
gc.unfreeze()
del ctl
gc.collect()
warm, res2, _ = start()   # a controller restart: every entry already in the maps
print(json.dumps({"seconds": cold, "added": res.added, "rss_mb": hwm, "steady_rss_mb": steady,
                  "restart_seconds": warm, "restart_written": res2.changed, **drift}))
"""


def full_sync(n: int) -> dict:
    from kxlb.lab.netlab import unique_tag
    from kxlb.loader.compile import compile_datapath

    pin = f"/sys/fs/bpf/{unique_tag()}"
    try:
        compile_datapath(pin)
        svcs, slices = lists(n)
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for tag, items in (("s", svcs["items"]), ("e", slices["items"])):
                f.writelines(tag + json.dumps(o) + "\n" for o in items)
        out = subprocess.run([sys.executable, "-c", CHILD, pin, f.name], capture_output=True, text=True, check=True)
        os.unlink(f.name)
        return json.loads(out.stdout)
    finally:
        shutil.rmtree(pin, ignore_errors=True)


# --- a benchmark cluster ------------------------------------------------------------------------
class BenchCluster:
    """A real control plane, a netns node with `kxlb controller` (started by
    ``controller()``), and an admin API client; everything removed on exit, also after a
    failure. The controller tests' fixtures (tests/controller/conftest.py) do the work."""

    def __init__(self, workdir: str, port_shift: int, iface: str, advertise_address: str):
        sys.path.insert(0, str(ROOT / "tests" / "controller"))
        import conftest as c  # the controller tests' fixtures, used here as plain code
        from kxlb.lab.controlplane import ControlPlane

        self.c = c
        self.cp = ControlPlane(Path(workdir), ports=c.PORTS.shifted(port_shift), iface=iface,
                               advertise_address=advertise_address, controllers="*,-nodeipam,-nodelifecycle",
                               log=lambda m: None)
        self.lab = self.ctl = self.api = None

    def __enter__(self) -> "BenchCluster":
        from kubernetes import client, config

        from kxlb.lab.netlab import NetLab

        self.cp.up()
        try:
            self.lab = NetLab().up()
            cfg = client.Configuration()
            config.load_kube_config(config_file=str(self.cp.admin_kubeconfig), client_configuration=cfg)
            cfg.connection_pool_maxsize = 16
            self.api = client.ApiClient(cfg)
        except BaseException:
            self.__exit__()
            raise
        return self

    def controller(self, wait_ready: bool = True, extra: list[str] | None = None):
        self.ctl = self.c.ControllerProcess(self.cp, self.lab, extra=extra, test_periods=False)
        self.ctl.start(wait_ready=wait_ready)
        return self.ctl

    def __exit__(self, *exc) -> None:
        if self.ctl:
            self.ctl.kill()
        if self.lab:
            subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", self.lab.pin_dir, "unload"],
                           capture_output=True)
            if self.ctl and os.path.isdir(self.ctl.cgroup):
                os.rmdir(self.ctl.cgroup)
            self.lab.down()
        self.cp.down()


# --- 2. event to datapath ---------------------------------------------------------------------
def event_latency(iterations: int, traffic_iterations: int) -> dict:
    from kubernetes import client

    from kxlb.lab.client import tcp_request
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    with BenchCluster("/tmp/kxlb-bench-cp", 500, "kxlb-apibch0", "10.254.0.5") as bc:
        c, lab, api = bc.c, bc.lab, bc.api
        lab.start_servers(c.BACKEND_PORT)
        ctl = bc.controller()
        client.CoreV1Api(api).create_namespace({"metadata": {"name": "bench"}})
        svc = c.make_service(api, "bench", "lat", [("http", 80, "TCP")], [(lab.backend_ip(0), c.READY)])
        key = ServiceKey(svc["spec"]["clusterIP"], 80, 6)
        table = ServiceTable(Maps.open(lab.pin_dir))
        to_maps, to_traffic, after_write = [], [], []
        for i in range(iterations + traffic_iterations):
            target = (i + 1) % 2  # the only backend alternates: be1, be0, be1, ...
            want = Backend(lab.backend_ip(target), c.BACKEND_PORT)
            t0 = time.perf_counter()
            c.put_slice(api, "bench", "lat", [(want.addr, c.READY)], [("http", c.BACKEND_PORT, "TCP")])
            t_written = time.perf_counter()
            while True:
                if table.read_backends(key) == (want,):
                    break
            t1 = time.perf_counter()
            to_maps.append(t1 - t0)
            after_write.append(t1 - t_written)
            if i >= iterations:  # and the first request the new backend answers
                while tcp_request(lab.client, key.vip, 80)[0].split()[0] != f"be{target}":
                    pass
                to_traffic.append(time.perf_counter() - t0)
        return {"maps": to_maps, "traffic": to_traffic, "after_write": after_write,
                "controller_rss_mb": rss_mb(ctl.proc.pid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--iterations", type=int, default=200, help="slice writes timed to the maps")
    ap.add_argument("--traffic-iterations", type=int, default=40, help="slice writes timed to the first answer")
    ap.add_argument("--sync-only", action="store_true", help="only the full sync rows")
    a = ap.parse_args()
    rows = [(n, full_sync(n)) for n in (int(s) for s in a.sizes.split(","))]
    print("| services x 10 endpoints | full sync, empty maps s | full sync after a restart s | "
          "RSS MB after the sync | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in rows:
        assert r["added"] == n and r["restart_written"] == 0, r
        print(f"| {n:,} | {r['seconds']:.3f} | {r['restart_seconds']:.3f} | {r['steady_rss_mb']:.0f} | "
              f"{r['rss_mb']:.0f} |")
    print("\n| services x 10 endpoints | 0.2's hourly resync, one run s | drift check: cycle start ms "
          "| share p50 / max ms (120 runs) | whole cycle s |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in rows:
        print(f"| {n:,} | {r['resync_s']:.2f} | {r['share_start_ms']:.1f} | {r['share_p50_ms']:.1f} / "
              f"{r['share_max_ms']:.1f} | {r['cycle_s']:.2f} |")
    if a.sync_only:
        return
    lat = event_latency(a.iterations, a.traffic_iterations)
    ms = lambda xs, p: pct(xs, p) * 1000  # noqa: E731
    print("\n| API write (EndpointSlice) to | n | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    print(f"| maps updated (from the write's start) | {len(lat['maps'])} | {ms(lat['maps'], 50):.2f} | "
          f"{ms(lat['maps'], 99):.2f} |")
    print(f"| maps updated (from the write's response) | {len(lat['after_write'])} | "
          f"{ms(lat['after_write'], 50):.2f} | {ms(lat['after_write'], 99):.2f} |")
    print(f"| first connection answered by the new backend | {len(lat['traffic'])} | "
          f"{ms(lat['traffic'], 50):.2f} | {ms(lat['traffic'], 99):.2f} |")
    print(f"\n`kxlb controller` RSS while running (its BCC compile runs in a child process): "
          f"{lat['controller_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
