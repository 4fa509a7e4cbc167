"""The command line on a big node: 70,000 service ports of 10 backends each in the pinned
maps (as a 70k-Service cluster leaves them), then `kxlb service add`, `list VIP...` and
`service del`, timed two ways in one run:

- the whole command, as an operator's script sees it (a new Python process: interpreter
  start and imports included; `python -c pass` and `kxlb --version` are given beside it
  as the floors);
- the operation inside the process: a keyed ServiceTable (what the command uses: one
  pass over the frontend maps, direct lookups of the slots it touches) against the full
  read every command did before (every frontend, slot, Maglev chunk and range).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from stats import pct  # noqa: E402


def populate(pin: str, n: int) -> None:
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable
    from kxlb.loader.svcspec import LbService

    with Maps.open(pin) as maps:
        table = ServiceTable(maps)
        for start in range(0, n, 10000):
            specs = []
            for i in range(start, min(n, start + 10000)):
                vip = f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"
                backends = [Backend(f"10.{128 + (i * 10 + j) // 65536 % 64}.{(i * 10 + j) // 256 % 256}."
                                    f"{(i * 10 + j) % 256}", 8080) for j in range(10)]
                specs.append(LbService.simple(ServiceKey(vip, 80, 6), backends))
            table.add_many(specs)


def wall(argv: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True)
        out.append((time.perf_counter() - t0) * 1000)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)}: {r.stderr.strip()}")
    return out


def in_process(pin: str, runs: int) -> dict[str, list[float]]:
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.services import ServiceTable
    from kxlb.loader.writer import writing

    out: dict[str, list[float]] = {"add (keyed)": [], "del (keyed)": [], "list VIP:PORT/PROTO": [],
                                   "full read (before)": []}
    key = ServiceKey("10.200.0.1", 80, 6)
    with writing(pin) as w:
        maps = w.maps
        for _ in range(runs):  # as `kxlb service add/del` do them: the journal and the id bitmap included
            t0 = time.perf_counter()
            ServiceTable(maps, journal=w.journal, keyed=True, ids=w.ids).add(
                key, [Backend("10.250.0.1", 80), Backend("10.250.0.2", 80)])
            t1 = time.perf_counter()
            ServiceTable(maps, journal=w.journal, keyed=True, ids=w.ids).delete(key)
            t2 = time.perf_counter()
            ServiceTable(maps).read_matching("10.96.0.7", 80, 6)
            t3 = time.perf_counter()
            out["add (keyed)"].append((t1 - t0) * 1000)
            out["del (keyed)"].append((t2 - t1) * 1000)
            out["list VIP:PORT/PROTO"].append((t3 - t2) * 1000)
        for _ in range(min(runs, 3)):
            t0 = time.perf_counter()
            ServiceTable(maps).reload()
            out["full read (before)"].append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=70000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from kxlb.lab.netlab import unique_tag
    from kxlb.loader import datapath

    pin = f"/sys/fs/bpf/{unique_tag()}"
    try:
        datapath.load([], pin_dir=pin)  # as on a node: the registry, the id bitmap
        t0 = time.perf_counter()
        populate(pin, args.services)
        print(f"{args.services} service ports written in {time.perf_counter() - t0:.1f} s")
        kxlb = [sys.executable, "-m", "kxlb", "--pin-dir", pin]
        rows = {
            "python -c pass (floor)": wall([sys.executable, "-c", "pass"], args.runs),
            "kxlb --version (imports)": wall(kxlb + ["--version"], args.runs),
            "kxlb service add": [],
            "kxlb service del": [],
            "kxlb list VIP:PORT/PROTO --json": wall(kxlb + ["list", "10.96.0.7:80/tcp", "--json"], args.runs),
        }
        for _ in range(args.runs):
            rows["kxlb service add"] += wall(kxlb + ["service", "add", "10.200.0.2:80/tcp", "10.250.0.3:80"], 1)
            rows["kxlb service del"] += wall(kxlb + ["service", "del", "10.200.0.2:80/tcp"], 1)
        print(f"\n| at {args.services:,} service ports | p50 ms | max ms |\n|---|---:|---:|")
        for name, ms in {**rows, **in_process(pin, args.runs)}.items():
            print(f"| {name} | {pct(ms, 50):.1f} | {max(ms):.1f} |")
    finally:
        shutil.rmtree(pin, ignore_errors=True)


if __name__ == "__main__":
    main()
