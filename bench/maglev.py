"""Maglev backend choice against the old ``hash % N``: the share of flows that move when one
backend is added (3 -> 4, 10 -> 11, 100 -> 101) and the spread over backends, in the
real datapath (BPF_PROG_TEST_RUN) and in the tables; what the tables cost (fill time in
Python, map memory at 20,000 service ports x 10 endpoints, the datapath's extra lookup).

Moved share: the same 4-tuples sent as new flows before and after the change (conntrack
emptied in between), the fraction whose backend differs; the ideal is 1/(N+1). Spread:
the most and least loaded backend's flows over the fair share. The modulo rows are the
old choice (slot hash % N, the set in order, a new backend appended) over the same number
of uniformly distributed hashes.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from collections import Counter

from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from kxlb.lab.netlab import unique_tag
from kxlb.loader import maglev
from kxlb.loader.bpfsys import prog_test_run
from kxlb.loader.compile import compile_datapath
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable
from kxlb.loader.svcspec import LbService

CASES = (3, 10, 100)
VIP, PORT = "10.96.9.9", 80
SVC = ServiceKey(VIP, PORT, 6)


def backends(n: int, base: int = 0) -> list[Backend]:
    return [Backend(f"10.1.{(base + j) // 250}.{(base + j) % 250 + 1}", 8080) for j in range(n)]


def frames(count: int) -> list[bytes]:
    """Built before any timing (scapy between calls would leave the caches cold)."""
    return [bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") /
                  IP(src=f"10.8.{i // 250 % 250}.{i % 250 + 1}", dst=VIP) /
                  TCP(sport=1024 + (i * 7919) % 60000, dport=PORT, flags="S")) for i in range(count)]


def sent_to(fd: int, fr: list[bytes]) -> list[tuple[bytes, bytes]]:
    out = []
    for raw in fr:
        res = prog_test_run(fd, raw)[1]
        out.append((res[30:34], res[36:38]))  # destination address and port (no IP options)
    return out


def spread(picks, n: int) -> tuple[float, float]:
    c = Counter(picks)
    fair = len(picks) / n
    return max(c.values()) / fair, (min(c.values()) if len(c) == n else 0) / fair


def datapath_rows(fd: int, maps: Maps, n_flows: int) -> list[dict]:
    table = ServiceTable(maps)
    fr = frames(n_flows)
    rows = []
    for n in CASES:
        before_set, after_set = backends(n), backends(n + 1)
        table.add(SVC, before_set)
        for k in list(maps.conntrack.keys()):
            maps.conntrack.delete(k)
        before = sent_to(fd, fr)
        table.set_backends(SVC, after_set)
        m = table.get(SVC).tables[0]
        for k in list(maps.conntrack.keys()):
            maps.conntrack.delete(k)
        after = sent_to(fd, fr)
        table.delete(SVC)
        hi, lo = spread(after, n + 1)
        rows.append({"n": n, "m": m, "moved": sum(a != b for a, b in zip(before, after)) / n_flows,
                     "hi": hi, "lo": lo})
    for k in list(maps.conntrack.keys()):
        maps.conntrack.delete(k)
    return rows


def modulo_rows(n_flows: int) -> list[dict]:
    rng = random.Random(8)
    hashes = [rng.getrandbits(32) for _ in range(n_flows)]
    rows = []
    for n in CASES:
        before, after = [h % n for h in hashes], [h % (n + 1) for h in hashes]
        hi, lo = spread(after, n + 1)
        rows.append({"n": n, "moved": sum(a != b for a, b in zip(before, after)) / n_flows, "hi": hi, "lo": lo})
    return rows


def table_rows() -> list[dict]:
    """The whole hash space: entries that change owner, and entries per backend."""
    rows = []
    for n in CASES:
        m = maglev.table_size(n + 1)
        a, b = backends(n, base=500), backends(n + 1, base=500)
        ta, tb = [a[s] for s in maglev.lookup_table(a, m)], [b[s] for s in maglev.lookup_table(b, m)]
        c = Counter(tb)
        rows.append({"n": n, "m": m, "moved": sum(x != y for x, y in zip(ta, tb)) / m,
                     "min": min(c.values()), "max": max(c.values())})
    return rows


def fill_times() -> list[tuple[int, int, float]]:
    out = []
    for n, m in ((10, 251), (40, 1021), (10, 16381), (1000, 16381), (4096, 16381), (100, 65521)):
        idents = [maglev.identity(b) for b in backends(n, base=7000)]
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            maglev.populate(idents, m)
            runs.append(time.perf_counter() - t0)
        out.append((n, m, min(runs) * 1000))
    return out


def slab_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("Slab:"):
            return int(line.split()[1])
    return 0


def memory_at_scale(maps: Maps, services: int, endpoints: int) -> dict:
    """Add ``services`` service ports of ``endpoints`` each in one batch (the controller's
    full sync path); the maglev map's chunks, and the kernel memory they took."""
    table = ServiceTable(maps)
    specs = [LbService.simple(ServiceKey(f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}", 80, 6),
                              [Backend(f"10.{128 + (i * endpoints + j) // 65536 % 64}.{(i * endpoints + j) // 256 % 256}."
                                       f"{(i * endpoints + j) % 256}", 8080) for j in range(endpoints)])
              for i in range(services)]
    maglev._table_bytes.cache_clear()
    t0 = time.perf_counter()  # hashing and filling from Backend objects (add_many fills its own, uncached)
    for s in specs:
        maglev.chunks(s.cluster, table.tables_for(s)[0])
    t_tables = time.perf_counter() - t0
    before = slab_kib()
    t0 = time.perf_counter()
    table.add_many(specs)
    t_add = time.perf_counter() - t0
    time.sleep(0.5)
    chunks = sum(1 for _ in maps.maglev.keys())
    return {"chunks": chunks, "slab_mib": (slab_kib() - before) / 1024, "tables_s": t_tables, "add_s": t_add,
            "m": table.tables_for(specs[0])[0]}


def big_set(fd: int, maps: Maps, n: int, n_flows: int) -> list[dict]:
    """One service port of ``n`` endpoints (more than the 4,096 a set once could hold: a
    DaemonSet Service on a large cluster), under the default largest table (16381) and
    the largest there is (65521): the write (hashing, fill, slots, table chunks), the
    table's entries per backend, and new flows through the datapath spread over them."""
    rows = []
    for m_max in (maglev.DEFAULT_TABLE_SIZE, maglev.MAX_TABLE):
        table = ServiceTable(maps, maglev_table_size=m_max)
        bs = backends(n, base=20000)
        maglev._table_bytes.cache_clear()
        t0 = time.perf_counter()
        table.add(SVC, bs)
        t_add = time.perf_counter() - t0
        m = table.get(SVC).tables[0]
        c = Counter(maglev.lookup_table(bs, m))
        fr = frames(n_flows)
        got = Counter(sent_to(fd, fr))
        table.delete(SVC)
        for k in list(maps.conntrack.keys()):
            maps.conntrack.delete(k)
        rows.append({"n": n, "m": m, "add_ms": t_add * 1000, "entries": (min(c.values()), max(c.values())),
                     "reached": len(got), "flows": n_flows})
    return rows


def lookup_cost(fd: int, maps: Maps, calls: int) -> tuple[float, float]:
    """Median ns of a new flow to a set of 1 backend (no table) and of 10 (one table lookup
    more), frames built beforehand: the price of the table in the datapath."""
    table = ServiceTable(maps)
    fr = frames(calls)
    medians: dict[int, list[float]] = {1: [], 10: []}
    for _ in range(3):  # interleaved: this VM's run-to-run noise is larger than one lookup
        for n in (1, 10):
            table.add(SVC, backends(n))
            medians[n].append(statistics.median(prog_test_run(fd, raw)[2] for raw in fr))
            table.delete(SVC)
            for k in list(maps.conntrack.keys()):
                maps.conntrack.delete(k)
    return statistics.median(medians[1]), statistics.median(medians[10])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flows", type=int, default=20000, help="flows per datapath measurement (default %(default)s)")
    ap.add_argument("--services", type=int, default=20000, help="service ports for the memory row")
    ap.add_argument("--big", type=int, default=10000, help="endpoints of the one large service port (default %(default)s)")
    a = ap.parse_args()
    pin = f"/sys/fs/bpf/{unique_tag()}"
    try:
        dp = compile_datapath(pin)
        with Maps.open(pin) as maps:
            dprows = datapath_rows(dp.tc_fd, maps, a.flows)
            one, ten = lookup_cost(dp.tc_fd, maps, min(a.flows, 5000))
            mem = memory_at_scale(maps, a.services, 10)
            big = big_set(dp.tc_fd, maps, a.big, a.flows)
    finally:
        shutil.rmtree(pin, ignore_errors=True)
    mod = modulo_rows(a.flows)
    print(f"Backend added, {a.flows} new flows each time (tc program, BPF_PROG_TEST_RUN); ideal = 1/(N+1).")
    print("| N -> N+1 | choice | M | moved | ideal | moved / ideal | busiest / fair | idlest / fair |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for d, o in zip(dprows, mod):
        n, ideal = d["n"], 1 / (d["n"] + 1)
        print(f"| {n} -> {n + 1} | Maglev (datapath) | {d['m']} | {d['moved']:.3f} | {ideal:.3f} | "
              f"{d['moved'] / ideal:.2f} | {d['hi']:.2f} | {d['lo']:.2f} |")
        print(f"| {n} -> {n + 1} | hash % N (old) | - | {o['moved']:.3f} | {ideal:.3f} | "
              f"{o['moved'] / ideal:.2f} | {o['hi']:.2f} | {o['lo']:.2f} |")
    print("\nThe tables themselves (all M entries): entries that change backend, entries per backend after.")
    print("| N -> N+1 | M | entries moved | moved / ideal | entries per backend (min-max) |")
    print("|---|---:|---:|---:|---|")
    for r in table_rows():
        print(f"| {r['n']} -> {r['n'] + 1} | {r['m']} | {r['moved']:.3f} | {r['moved'] * (r['n'] + 1):.2f} | "
              f"{r['min']}-{r['max']} |")
    print("\nFilling one table (hashing and fill, loader/_maglev.c; best of 3):")
    for n, m, ms in fill_times():
        print(f"  {n:5} backends, M {m:5}: {ms:7.2f} ms")
    print(f"\n{a.services:,} service ports x 10 endpoints (M {mem['m']}): {mem['chunks']:,} table chunks, "
          f"{mem['slab_mib']:.1f} MiB of kernel slab for the whole add (tables, slots, frontends); their tables "
          f"take {mem['tables_s']:.2f} s to compute of the {mem['add_s']:.2f} s the batch add (add_many) took")
    print(f"\nOne service port of {a.big:,} endpoints (over the 4,096 a set once held), {a.flows:,} new flows:")
    print("| largest table | M | write (fill, slots, chunks) ms | table entries per backend (min-max) | backends reached |")
    print("|---:|---:|---:|---|---:|")
    for r, m_max in zip(big, (maglev.DEFAULT_TABLE_SIZE, maglev.MAX_TABLE)):
        print(f"| {m_max} | {r['m']} | {r['add_ms']:.0f} | {r['entries'][0]}-{r['entries'][1]} | "
              f"{r['reached']:,} of {r['n']:,} |")
    calls = min(a.flows, 5000)
    print(f"New flow, tc, median of medians of 3 x {calls}: 1 backend (no table) {one:.0f} ns, 10 backends (table "
          f"lookup) {ten:.0f} ns ({ten - one:+.0f} ns)")


if __name__ == "__main__":
    sys.exit(main())
