"""Datapath microbenchmark: ns per packet with BPF_PROG_TEST_RUN, tc and XDP, new and
established flows, with 1 to 100k services in the maps, against a pass-through program
measured the same way in the same run.

Each measurement is one packet per syscall (repeat=1): with repeat > 1 the kernel runs
the program again on the buffer it already rewrote (then addressed to the backend), and
would measure the "not ours" path instead. The kernel reports the time spent around
the program run only, so the syscall is not counted; the small timer overhead that
remains is in the baseline too, and the table gives both raw figures and the figure
minus the baseline. New flows use a fresh source each call; established flows send the
same tracked flow each call.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from kxlb.lab.netlab import unique_tag
from kxlb.loader.bpfsys import prog_test_run
from kxlb.loader.compile import compile_datapath
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable
from kxlb.loader.svcspec import LbService

SIZES = (1, 1_000, 10_000, 100_000)


def frame(src: str, sport: int, vip: str, port: int) -> bytes:
    return bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(src=src, dst=vip) /
                 TCP(sport=sport, dport=port, flags="A") / (b"x" * 64))


def vip_of(i: int) -> tuple[str, int]:
    return f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}", 80


def median_ns(fd: int, frames, calls: int) -> float:
    return statistics.median(prog_test_run(fd, frames(i))[2] for i in range(calls))


def run(calls: int, sizes=SIZES) -> list[dict]:
    from bcc import BPF

    ref = BPF(src_file=str(Path(__file__).with_name("reference.c")).encode())
    base_fd = {"tc": ref.load_func(b"pass_tc", BPF.SCHED_CLS).fd, "xdp": ref.load_func(b"pass_xdp", BPF.XDP).fd}
    rows = []
    for n in sizes:
        pin = f"/sys/fs/bpf/{unique_tag()}"
        try:
            dp = compile_datapath(pin)
            with Maps.open(pin) as maps:
                table = ServiceTable(maps)
                table.add_many(LbService.simple(ServiceKey(*vip_of(i), 6),
                                                [Backend(f"10.1.{j}.{i % 250 + 1}", 8080) for j in range(3)])
                               for i in range(n))
                vip, port = vip_of(n // 2)
                prog = {"tc": dp.tc_fd, "xdp": dp.xdp_fd}
                est = frame("10.0.0.1", 40000, vip, port)
                for hook in ("tc", "xdp"):
                    prog_test_run(prog[hook], est)  # track the established flow once
                    new = lambda i, h=hook: frame(f"10.{2 if h == 'tc' else 3}.{i // 60000}.1", 1024 + i % 60000, vip, port)  # noqa: E731
                    b = median_ns(base_fd[hook], lambda i: est, calls)
                    e = median_ns(prog[hook], lambda i: est, calls)
                    nf = median_ns(prog[hook], new, calls)
                    rows.append({"services": n, "hook": hook, "baseline_ns": b, "established_ns": e,
                                 "new_flow_ns": nf, "established_minus_base": e - b, "new_flow_minus_base": nf - b,
                                 "new_flows_in_ct": len(maps.conntrack.items()) // 2})
        finally:
            shutil.rmtree(pin, ignore_errors=True)
    return rows


VARIANT_SERVICES = 1_000
NODE_IP = "10.250.0.11"


def variants(calls: int) -> list[dict]:
    """The same measurement for other frontends of one service port among 1,000: the
    cluster IP (the table's path), a NodePort (external frontend: masquerade to the node),
    and a cluster IP with sessionAffinity ClientIP (one more LRU lookup and update)."""
    from kxlb.loader.services import DatapathConfig
    from kxlb.loader.svcspec import Frontend, Kind

    rows = []
    pin = f"/sys/fs/bpf/{unique_tag()}"
    try:
        dp = compile_datapath(pin)
        with Maps.open(pin) as maps:
            table = ServiceTable(maps)
            table.set_config(DatapathConfig(snat_addr=NODE_IP, cluster_cidr="10.0.0.0/8"))
            backends = lambda i: [Backend(f"10.1.{j}.{i % 250 + 1}", 8080) for j in range(3)]  # noqa: E731
            specs = [LbService.simple(ServiceKey(*vip_of(i), 6), backends(i)) for i in range(VARIANT_SERVICES - 2)]
            specs.append(LbService(ServiceKey("10.99.0.1", 80, 6), cluster=tuple(backends(1)), has_endpoints=True,
                                   frontends=(Frontend(ServiceKey(NODE_IP, 30080, 6), Kind.NODE_PORT),)))
            specs.append(LbService(ServiceKey("10.99.0.2", 80, 6), cluster=tuple(backends(2)), has_endpoints=True,
                                   affinity_s=10800))
            table.add_many(specs)
            targets = (("clusterIP", *vip_of(VARIANT_SERVICES // 2)), ("nodePort", NODE_IP, 30080),
                       ("affinity", "10.99.0.2", 80))
            for hook, fd in (("tc", dp.tc_fd), ("xdp", dp.xdp_fd)):
                for k, (name, addr, port) in enumerate(targets):
                    est = frame("10.0.0.1", 40000 + k, addr, port)
                    prog_test_run(fd, est)
                    prefix = f"10.{4 + 2 * k + (hook == 'xdp')}"  # outside 10.0/16 clients: masquerade applies
                    new = lambda i, p=prefix: frame(f"{p}.{i // 60000}.1", 1024 + i % 60000, addr, port)  # noqa: E731
                    rows.append({"frontend": name, "hook": hook,
                                 "established_ns": median_ns(fd, lambda i: est, calls),
                                 "new_flow_ns": median_ns(fd, new, calls)})
    finally:
        shutil.rmtree(pin, ignore_errors=True)
    return rows


def variants_table(rows: list[dict]) -> str:
    base = {(r["hook"]): r for r in rows if r["frontend"] == "clusterIP"}
    out = ["| frontend (1,000 services) | hook | established ns | new flow ns | new / clusterIP new |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['frontend']} | {r['hook']} | {r['established_ns']:.0f} | {r['new_flow_ns']:.0f} | "
                   f"{r['new_flow_ns'] / max(base[r['hook']]['new_flow_ns'], 1):.2f}x |")
    return "\n".join(out)


def primitives(calls: int) -> dict[str, float]:
    """ns of single kernel primitives (XDP, one packet per syscall), minus pass-through."""
    from bcc import BPF

    ref = BPF(src_file=str(Path(__file__).with_name("reference.c")).encode())
    pkt = frame("10.0.0.1", 1, "10.0.0.2", 80)
    base = median_ns(ref.load_func(b"pass_xdp", BPF.XDP).fd, lambda i: pkt, calls)
    out = {}
    for name, fn in (("helper call (clock)", b"prim_clock"), ("hash lookup + helper", b"prim_lookup"),
                     ("hash insert, new key", b"prim_insert"), ("LRU insert, new key", b"prim_lru_insert")):
        out[name] = median_ns(ref.load_func(fn, BPF.XDP).fd, lambda i: pkt, calls) - base
    return out


def machine_notes() -> str:
    try:
        srso = Path("/sys/devices/system/cpu/vulnerabilities/spec_rstack_overflow").read_text().strip()
    except OSError:
        srso = "unknown"
    return f"kernel {os.uname().release}, {os.cpu_count()} CPUs, spec_rstack_overflow: {srso}"


def table(rows: list[dict]) -> str:
    out = ["| services | hook | pass-through ns | established ns (-base) | new flow ns (-base) | est/base | new/base |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['services']:,} | {r['hook']} | {r['baseline_ns']:.0f} | "
                   f"{r['established_ns']:.0f} ({r['established_minus_base']:.0f}) | "
                   f"{r['new_flow_ns']:.0f} ({r['new_flow_minus_base']:.0f}) | "
                   f"{r['established_ns'] / max(r['baseline_ns'], 1):.1f}x | {r['new_flow_ns'] / max(r['baseline_ns'], 1):.1f}x |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="packets per measurement (default %(default)s)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="service counts, comma-separated")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args()
    rows = run(a.calls, [int(s) for s in a.sizes.split(",")])
    var = variants(a.calls)
    prims = primitives(a.calls)
    print(table(rows))
    print("\nother frontends and options of one service port, same method:")
    print(variants_table(var))
    print("\nkernel primitives on this machine (ns over pass-through, same method):")
    for name, ns in prims.items():
        print(f"  {name:24} {ns:6.0f}")
    print(f"\n{machine_notes()}; median of {a.calls} packets per cell")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "variants": var, "primitives": prims, "machine": machine_notes()}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
