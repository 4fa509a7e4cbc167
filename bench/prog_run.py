"""Datapath microbenchmark: ns per packet with BPF_PROG_TEST_RUN, kxlb beside Katran's
XDP balancer in the same run, then kxlb alone with 1 to 100k services and with other
frontends and options.

Method (the same for every row and for Katran, bench/testrun.py): every frame of a cell
is built and copied into its own buffer before the first timed call, then one
BPF_PROG_TEST_RUN call per frame (repeat=1); a cell's figure is the median of its
frames. A new flow is N distinct frames, each from a fresh client address/port; an
established flow is N copies of one tracked flow's frame. (Building each frame with
scapy between calls, as this benchmark once did, left the caches cold and tripled the
new-flow figures.) Every cell is checked after timing: the verdict, where the last frame
was sent, and the datapath's counters (every new-flow frame made a new flow, every
established frame hit its flow).

Spread: a figure is the median of several rounds' medians, with their min and max.
kxlb vs Katran: each round loads a fresh kxlb datapath and a fresh Katran (the anchor
benchmark, run unchanged in a child process, bench/katran.py), alternating which goes
first, so the machine's noise hits both; ratios are taken per round, then summarised.
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # frames, testrun, katran
ROOT = Path(__file__).resolve().parent.parent


def _run_at_revision() -> None:
    """``--rev REV``: measure the datapath and its loader as committed at REV (while
    bpf/ and loader/ are being edited in the checkout, the two must match). The tree is
    exported with `git archive` into a temporary directory, laid out as the `kxlb`
    package, and this script runs again with that package first on PYTHONPATH."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--rev")
    known, rest = pre.parse_known_args()
    if not known.rev or os.environ.get("KXLB_BENCH_REV"):
        return
    with tempfile.TemporaryDirectory(prefix="kxlb-bench-tree-") as tmp:
        src, pkg = Path(tmp) / "src", Path(tmp) / "pkg" / "kxlb"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", known.rev, "bpf", "kxlb", "loader", "lab",
                                  "controller"], capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"prog_run: cannot export {known.rev!r}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{known.rev}^{{commit}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
        shutil.copytree(src / "kxlb", pkg)  # kxlb.loader is loader/ etc., as pyproject.toml maps them
        for sub in ("loader", "lab", "controller"):
            (pkg / sub).symlink_to(src / sub)  # loader/compile.py finds bpf/ beside loader/ (resolved)
        env = dict(os.environ, KXLB_BENCH_REV=f"{known.rev} = {commit}" if commit != known.rev else commit,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(pkg.parent), os.environ.get("PYTHONPATH")])))
        sys.exit(subprocess.run([sys.executable, __file__, *rest], env=env).returncode)


if __name__ == "__main__":
    _run_at_revision()

from tqdm import tqdm  # noqa: E402

import katran  # noqa: E402
from frames import ACK, SYN, fresh_clients, ip_dst, ip_src, tcp, udp  # noqa: E402
from testrun import Spread, Timed, prebuilt, time_frames  # noqa: E402

from kxlb.lab.netlab import unique_tag  # noqa: E402
from kxlb.loader.compile import MAIN_SOURCE, compile_source, load_entry_programs  # noqa: E402
from kxlb.loader.layout import Backend, ServiceKey, canonical_ip  # noqa: E402
from kxlb.loader.maps import Maps  # noqa: E402
from kxlb.loader.netns import netns  # noqa: E402
from kxlb.loader.services import DatapathConfig, ServiceTable  # noqa: E402
from kxlb.loader.svcspec import Frontend, Kind, LbService  # noqa: E402

# Verdicts: a translated frame continues up the stack (TC_ACT_OK, XDP_PASS); tc hands a
# frame that is not ours on to the next filter (TC_ACT_UNSPEC, -1) since issue 8 item 6.
TRANSLATED = {"tc": {0}, "xdp": {2}}
UNTOUCHED = {"tc": {0, 0xFFFFFFFF}, "xdp": {2}}
HOOKS = ("xdp", "tc")
SIZES = (1, 1_000, 10_000, 100_000)
# Issue 26's targets (issue 8's, plus not-a-service <= 1.0x).
TARGETS = {"non_vip": 1.00, "established": 0.70, "new_flow_syn": 0.80, "new_flow_ack": 0.80}
LABELS = {"empty": "empty program", "non_vip": "pass-through (not a service)",
          "established": "established flow", "new_flow_syn": "new flow (SYN)", "new_flow_ack": "new flow (ACK)"}


# --- the programs -----------------------------------------------------------------------

@dataclass
class Kxlb:
    """A freshly compiled kxlb datapath with its own pinned maps (so its conntrack starts
    empty, as Katran's fresh load does)."""

    fd: dict[str, int]
    table: ServiceTable
    bpf: object = field(repr=False)

    def counters(self) -> dict[str, int]:
        return self.table.datapath_counters()


@contextmanager
def kxlb_datapath(source: Path):
    pin = f"/sys/fs/bpf/{unique_tag()}"
    bpf = None
    try:
        bpf = compile_source(source, pin)
        tc, xdp = load_entry_programs(bpf)   # and the IPv6 programs they tail-call
        fd = {"tc": tc.fd, "xdp": xdp.fd}
        with Maps.open(pin) as maps:
            yield Kxlb(fd, ServiceTable(maps), bpf)
    finally:
        if bpf is not None:
            bpf.cleanup()
        shutil.rmtree(pin, ignore_errors=True)


class Reference:
    """bench/reference.c: programs that return at once (the floor of every figure) and
    single kernel primitives, compiled once."""

    def __init__(self):
        from bcc import BPF

        self.bpf = BPF(src_file=str(Path(__file__).with_name("reference.c")).encode())
        self.empty = {"tc": self.bpf.load_func(b"pass_tc", BPF.SCHED_CLS).fd,
                      "xdp": self.bpf.load_func(b"pass_xdp", BPF.XDP).fd}

    def fd(self, name: bytes) -> int:
        from bcc import BPF

        return self.bpf.load_func(name, BPF.XDP).fd


# --- one checked cell ------------------------------------------------------------------------

class Wrong(RuntimeError):
    """The program did not do what the row claims: the figure would be meaningless."""


NOTES: list[str] = []  # known datapath shortcomings met while measuring, printed under the tables


def timed_cell(what: str, k: Kxlb | None, fd: int, bufs, *, hook: str, last: bytes,
               untouched: bool = False, to: set[tuple[str, int]] | None = None, snat: str | None = None,
               hits: str | None = None) -> float:
    """Time ``bufs`` (prebuilt; ``last`` is the last one's bytes) and check the result:
    ``untouched``: the frame came out byte-identical; ``to``: the last frame went to one
    of these (addr, port); ``snat``: from this address; ``hits``: every frame counted as
    "new" (a new flow) or "ct_fwd" (a tracked flow's packet) or "pass" by the datapath.
    The one tolerated miss: a masqueraded new flow that found no free masquerade port
    (dropped; issue 8 item 7), noted and left in the median (a handful among thousands)."""
    before = k.counters() if k and hits else None
    t: Timed = time_frames(fd, bufs)
    no_port = 0
    if before is not None:
        after = k.counters()
        d = {name: after[name] - before.get(name, 0) for name in after}
        n = len(bufs)
        if hits == "new":  # a new flow counts once, as new_flow or snat (masqueraded)
            no_port = d.get("snat_no_port", 0) if snat else 0
            got, extra = d.get("new_flow", 0) + d.get("snat", 0) + no_port, d.get("ct_fwd", 0)
        else:
            got, extra = d.get(hits, 0), d.get("new_flow", 0) + d.get("snat", 0)
        if got != n or extra:
            bad = {name: v for name, v in d.items() if v}
            raise Wrong(f"{what}: {n} frames, datapath counted {bad}")
        if no_port:
            NOTES.append(f"{what}: {no_port} of {n} new flows dropped, no free masquerade port")
    verdicts = (UNTOUCHED if untouched else TRANSLATED)[hook]
    if no_port and t.retval not in verdicts:
        return t.median  # the last frame was one of those dropped: nothing more to check
    if t.retval not in verdicts:
        raise Wrong(f"{what}: verdict {t.retval:#x}, expected one of {sorted(verdicts)}")
    if untouched and t.out != last:
        raise Wrong(f"{what}: the frame was rewritten")
    if to is not None and ip_dst(t.out) not in to:
        raise Wrong(f"{what}: the last frame went to {ip_dst(t.out)}, not one of {sorted(to)}")
    if snat is not None and ip_src(t.out)[0] != snat:
        raise Wrong(f"{what}: the last frame left from {ip_src(t.out)}, not masqueraded to {snat}")
    return t.median


# --- kxlb vs Katran ----------------------------------------------------------------------

def kxlb_round(source: Path, ref: Reference, calls: int) -> dict[tuple[str, str], float]:
    """kxlb programmed as the Katran anchor: one service at the anchor's VIP with its 3
    reals, timed on the anchor's frames, rows in the anchor's order (XDP, then tc with
    its own new clients)."""
    V, P = katran.VIP, katran.VIP_PORT
    reals = {(r, P) for r in katran.REALS}
    est = tcp(*katran.EST_CLIENT, V, P, ACK)
    non_vip = tcp(*katran.EST_CLIENT, katran.NON_VIP, P, ACK)
    nets = {("xdp", "new_flow_syn"): "10.64", ("xdp", "new_flow_ack"): "10.65",  # the anchor's clients
            ("tc", "new_flow_syn"): "10.66", ("tc", "new_flow_ack"): "10.67"}
    new = {key: [tcp(a, p, V, P, SYN if key[1] == "new_flow_syn" else ACK) for a, p in fresh_clients(net, calls)]
           for key, net in nets.items()}
    bufs = {"empty": prebuilt([est] * calls), "non_vip": prebuilt([non_vip] * calls),
            "established": prebuilt([est] * calls)}
    new_bufs = {key: prebuilt(f) for key, f in new.items()}  # all built before the first timed call
    out = {}
    with kxlb_datapath(source) as k:
        k.table.add_many([LbService.simple(ServiceKey(V, P, 6), [Backend(a, p) for a, p in sorted(reals)])])
        timed_cell("track the established flow", k, k.fd["xdp"], prebuilt([est]), hook="xdp", last=est,
                   to=reals, hits="new")
        for hook in HOOKS:
            fd = k.fd[hook]
            out[hook, "empty"] = timed_cell(f"{hook} empty", None, ref.empty[hook], bufs["empty"], hook=hook,
                                            last=est, untouched=True)
            out[hook, "non_vip"] = timed_cell(f"{hook} pass-through", k, fd, bufs["non_vip"], hook=hook,
                                              last=non_vip, untouched=True, hits="pass")
            out[hook, "established"] = timed_cell(f"{hook} established", k, fd, bufs["established"], hook=hook,
                                                  last=est, to=reals, hits="ct_fwd")
            for row in ("new_flow_syn", "new_flow_ack"):
                out[hook, row] = timed_cell(f"{hook} {row}", k, fd, new_bufs[hook, row], hook=hook,
                                            last=new[hook, row][-1], to=reals, hits="new")
    return out


def head_to_head(source: Path, ref: Reference, anchor: Path | None, calls: int, rounds: int, bar) -> dict:
    kx: list[dict] = []
    kt: list[dict] = []
    for r in range(rounds):
        order = ("kxlb", "katran") if r % 2 == 0 else ("katran", "kxlb")
        for who in order:
            if who == "kxlb":
                kx.append(kxlb_round(source, ref, calls))
            elif anchor is not None:
                kt.append(katran.run_round(anchor, calls))
            bar.update(1)
    res = {"rounds": rounds, "calls": calls, "rows": {}}
    for row in katran.ROWS:
        cell = {f"kxlb_{h}": Spread.of([x[h, row] for x in kx]) for h in HOOKS}
        if kt:
            cell["katran_xdp"] = Spread.of([t[row] for t in kt])
            cell["ratio"] = Spread.of([x["xdp", row] / t[row] for x, t in zip(kx, kt)])
        res["rows"][row] = cell
    return res


def head_to_head_table(res: dict) -> str:
    has_katran = "katran_xdp" in res["rows"]["empty"]
    out = ["| per packet, ns | kxlb XDP | Katran XDP | kxlb / Katran | target | met | kxlb tc |",
           "|---|---:|---:|---:|---:|:-:|---:|"]
    for row, c in res["rows"].items():
        tgt = TARGETS.get(row)
        if has_katran:
            kt, ratio = c["katran_xdp"].fmt(), c["ratio"].fmt(2)
            met = ("yes" if c["ratio"].median <= tgt else "no") if tgt else ""
        else:
            kt, ratio, met = "-", "-", "-" if tgt else ""
        out.append(f"| {LABELS[row]} | {c['kxlb_xdp'].fmt()} | {kt} | {ratio} | "
                   f"{f'<= {tgt:.2f}x' if tgt else ''} | {met} | {c['kxlb_tc'].fmt()} |")
    return "\n".join(out)


# --- kxlb alone: 1 to 100k services ------------------------------------------------------

def vip_of(i: int) -> tuple[str, int]:
    return f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}", 80


def backends_of(i: int) -> list[Backend]:
    return [Backend(f"10.1.{j}.{i % 250 + 1}", 8080) for j in range(3)]


def vip6_of(i: int) -> tuple[str, int]:
    return f"fd00:96::{i:x}", 80


def backends6_of(i: int) -> list[Backend]:
    return [Backend(canonical_ip(f"fd00:1:{j}::{i % 250 + 1:x}"), 8080) for j in range(3)]


def scaling(source: Path, ref: Reference, sizes, calls: int, rounds: int, bar) -> list[dict]:
    """One datapath per service count (filling 100k services takes seconds), ``rounds``
    rounds on it. New-flow cells get calls/2 fresh clients, at most 64k flows over all
    rounds, so the conntrack table (262,144 entries, two per flow today) stays well under
    half full: LRU eviction would be measured too otherwise."""
    n_new = max(1, min(calls // 2, 65536 // (len(HOOKS) * rounds)))
    rows = []
    for n in sizes:
        with kxlb_datapath(source) as k:
            k.table.add_many(LbService.simple(ServiceKey(*vip_of(i), 6), backends_of(i)) for i in range(n))
            vip, port = vip_of(n // 2)
            to = {(b.addr, b.port) for b in backends_of(n // 2)}
            est = tcp("10.9.9.9", 40000, vip, port)
            non_svc = tcp("10.9.9.9", 40000, "10.200.9.9", port)
            timed_cell("track", k, k.fd["xdp"], prebuilt([est]), hook="xdp", last=est, to=to, hits="new")
            per: dict[tuple[str, str], list[float]] = {}
            for r in range(rounds):
                for h, hook in enumerate(HOOKS):
                    fd = k.fd[hook]
                    new = [tcp(a, p, vip, port) for a, p in fresh_clients(f"10.{64 + 2 * r + h}", n_new)]
                    b_new, b_est, b_non = prebuilt(new), prebuilt([est] * calls), prebuilt([non_svc] * calls)
                    cells = {
                        "empty": timed_cell("empty", None, ref.empty[hook], b_est, hook=hook, last=est, untouched=True),
                        "non_vip": timed_cell(f"{n} {hook} pass-through", k, fd, b_non, hook=hook, last=non_svc,
                                              untouched=True, hits="pass"),
                        "established": timed_cell(f"{n} {hook} established", k, fd, b_est, hook=hook, last=est,
                                                  to=to, hits="ct_fwd"),
                        "new_flow_ack": timed_cell(f"{n} {hook} new flow", k, fd, b_new, hook=hook, last=new[-1],
                                                   to=to, hits="new"),
                    }
                    for name, v in cells.items():
                        per.setdefault((hook, name), []).append(v)
                bar.update(1)
        for hook in HOOKS:
            rows.append({"services": n, "hook": hook, "new_flow_frames": n_new,
                         **{name: Spread.of(per[hook, name]) for name in ("empty", "non_vip", "established",
                                                                          "new_flow_ack")}})
    return rows


def scaling_table(rows: list[dict]) -> str:
    out = ["| services | hook | empty program | pass-through | established | new flow (ACK) |",
           "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['services']:,} | {r['hook']} | {r['empty'].fmt()} | {r['non_vip'].fmt()} | "
                   f"{r['established'].fmt()} | {r['new_flow_ack'].fmt()} |")
    return "\n".join(out)


# --- kxlb alone: other frontends and options ----------------------------------------------

VARIANT_SERVICES = 1_000
NODE_IP = "10.250.0.11"
NODE_IP6 = "fd00:250::11"


@dataclass(frozen=True)
class Variant:
    name: str
    addr: str
    port: int
    backends: tuple[Backend, ...]
    proto: str = "tcp"
    client_net: str = "10"     # the clients' first octet (IPv6: first two groups); 10/8 and fd00:10::/32
    masqueraded: bool = False  # are the cluster CIDRs here

    def frame(self, client: str, sport: int) -> bytes:
        return (udp if self.proto == "udp" else tcp)(client, sport, self.addr, self.port)

    @property
    def established_client(self) -> str:
        return f"{self.client_net}:9::9" if ":" in self.client_net else f"{self.client_net}.9.9.9"

    def new_clients(self, second: int, n: int) -> list[tuple[str, int]]:
        net = f"{self.client_net}:{second:x}" if ":" in self.client_net else f"{self.client_net}.{second}"
        return fresh_clients(net, n)


UDP_BACKENDS = tuple(Backend(b.addr, 5353) for b in backends_of(3))
VARIANTS = (
    Variant("clusterIP", *vip_of(VARIANT_SERVICES // 2), tuple(backends_of(VARIANT_SERVICES // 2))),
    Variant("clusterIP, client outside the cluster CIDR (masquerade)", *vip_of(VARIANT_SERVICES // 2),
            tuple(backends_of(VARIANT_SERVICES // 2)), client_net="172", masqueraded=True),
    Variant("nodePort (masquerade)", NODE_IP, 30080, tuple(backends_of(1)), client_net="172", masqueraded=True),
    Variant("sessionAffinity ClientIP", "10.99.0.2", 80, tuple(backends_of(2))),
    Variant("clusterIP, UDP", "10.99.0.3", 53, UDP_BACKENDS, proto="udp"),
    # IPv6 (its own programs, reached by a tail call; 1,000 IPv6 services beside)
    Variant("clusterIP, IPv6", *vip6_of(VARIANT_SERVICES // 2), tuple(backends6_of(VARIANT_SERVICES // 2)),
            client_net="fd00:10"),
    Variant("nodePort (masquerade), IPv6", NODE_IP6, 30080, tuple(backends6_of(1)), client_net="2001:db8",
            masqueraded=True),
    Variant("clusterIP, UDP, IPv6", "fd00:99::3", 53, tuple(Backend(b.addr, 5353) for b in backends6_of(3)),
            proto="udp", client_net="fd00:10"),
)


def variant_services() -> list[LbService]:
    specs = [LbService.simple(ServiceKey(*vip_of(i), 6), backends_of(i)) for i in range(VARIANT_SERVICES - 3)]
    specs.append(LbService(ServiceKey("10.99.0.1", 80, 6), cluster=tuple(backends_of(1)), has_endpoints=True,
                           frontends=(Frontend(ServiceKey(NODE_IP, 30080, 6), Kind.NODE_PORT),)))
    specs.append(LbService(ServiceKey("10.99.0.2", 80, 6), cluster=tuple(backends_of(2)), has_endpoints=True,
                           affinity_s=10800))
    specs.append(LbService.simple(ServiceKey("10.99.0.3", 53, 17), UDP_BACKENDS))
    specs += [LbService.simple(ServiceKey(*vip6_of(i), 6), backends6_of(i)) for i in range(VARIANT_SERVICES - 2)]
    specs.append(LbService(ServiceKey("fd00:99::1", 80, 6), cluster=tuple(backends6_of(1)), has_endpoints=True,
                           frontends=(Frontend(ServiceKey(NODE_IP6, 30080, 6), Kind.NODE_PORT),)))
    specs.append(LbService.simple(ServiceKey("fd00:99::3", 53, 17), VARIANTS[-1].backends))
    return specs


def variants(source: Path, calls: int, rounds: int, bar) -> list[dict]:
    """Other frontends and options of one service port among 1,000: a fresh datapath per
    round (together they make more flows than one conntrack table should hold across
    rounds), calls/4 new flows per cell."""
    n_new = max(calls // 4, 1)
    per: dict[tuple[str, str, str], list[float]] = {}
    for r in range(rounds):
        with kxlb_datapath(source) as k:
            # The masquerade range the controller picks on a node with Linux's default
            # ephemeral and NodePort ranges (the datapath's fallback, 61000-65535, is
            # for a datapath nobody configured: these cells' flows would exhaust it).
            k.table.set_config(DatapathConfig(snat_addrs=(NODE_IP, NODE_IP6),
                                              cluster_cidrs=("10.0.0.0/8", "fd00:10::/32"),
                                              src_ports=(1024, 29999)))
            k.table.add_many(variant_services())
            for v_i, v in enumerate(VARIANTS):
                to = {(b.addr, b.port) for b in v.backends}
                snat = (NODE_IP6 if ":" in v.addr else NODE_IP) if v.masqueraded else None
                est = v.frame(v.established_client, 40000 + v_i)
                timed_cell(f"track {v.name}", k, k.fd["xdp"], prebuilt([est]), hook="xdp", last=est, to=to,
                           snat=snat, hits="new")
                for h, hook in enumerate(HOOKS):
                    second = 100 + 2 * v_i + h  # distinct per variant and hook; 10.100-10.109: no service
                    new = [v.frame(a, p) for a, p in v.new_clients(second, n_new)]
                    b_new, b_est = prebuilt(new), prebuilt([est] * calls)
                    per.setdefault((v.name, hook, "established"), []).append(
                        timed_cell(f"{v.name} {hook} established", k, k.fd[hook], b_est, hook=hook, last=est,
                                   to=to, snat=snat, hits="ct_fwd"))
                    per.setdefault((v.name, hook, "new_flow"), []).append(
                        timed_cell(f"{v.name} {hook} new flow", k, k.fd[hook], b_new, hook=hook, last=new[-1],
                                   to=to, snat=snat, hits="new"))
        bar.update(1)
    return [{"frontend": v.name, "hook": hook, "new_flow_frames": n_new,
             "established": Spread.of(per[v.name, hook, "established"]),
             "new_flow": Spread.of(per[v.name, hook, "new_flow"])}
            for hook in HOOKS for v in VARIANTS]


def variants_table(rows: list[dict]) -> str:
    base = {r["hook"]: r["new_flow"].median for r in rows if r["frontend"] == "clusterIP"}
    out = [f"| frontend ({VARIANT_SERVICES:,} services) | hook | established | new flow | new / clusterIP new |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['frontend']} | {r['hook']} | {r['established'].fmt()} | {r['new_flow'].fmt()} | "
                   f"{r['new_flow'].median / max(base[r['hook']], 1):.2f}x |")
    return "\n".join(out)


# --- the path MTU check of masqueraded packets ---------------------------------------------

PMTU_CLIENT, PMTU_BACKEND = ("172.16.0.9", 40000), Backend("10.1.0.11", 8080)


@contextmanager
def forwarding_namespace():
    """A namespace of our own where forwarding is on and the backend's subnet has a route
    (a veth, MTU 1500): a test run's packet arrives on its loopback device, and the
    datapath's route lookup is this namespace's (tests/test_prog_run_pmtu.py does the same)."""
    ns = f"{unique_tag()}-bench"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "d0", "type", "veth", "peer", "d1"],
                    ["addr", "add", "10.1.0.1/24", "dev", "d0"], ["link", "set", "d0", "up"],
                    ["link", "set", "d1", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, stderr=subprocess.DEVNULL)


PMTU_ROWS = (("1,400 bytes, DF: route looked up", 1400, True), ("1,400 bytes, no DF: no lookup", 1400, False),
             ("64-byte segment: no lookup", 118, True))


def path_mtu(source: Path, calls: int, rounds: int, bar) -> list[dict]:
    """What the route lookup of a large masqueraded packet costs (flow.tmpl.h
    masq_path_mtu): a masqueraded flow's established segments, the same frames but for the
    DF bit, which decides whether the lookup runs (a packet that may be fragmented is left
    to the kernel). They fit the route, so every one is translated as before."""
    cells: dict[tuple[str, str], list[float]] = {}
    client, (vip, port) = PMTU_CLIENT, vip_of(0)
    with forwarding_namespace() as ns:
        for _ in range(rounds):
            with kxlb_datapath(source) as k:
                k.table.set_config(DatapathConfig(snat_addrs=(NODE_IP,), cluster_cidrs=("10.0.0.0/8",),
                                                  src_ports=(1024, 29999)))
                k.table.add_many([LbService.simple(ServiceKey(vip, port, 6), [PMTU_BACKEND])])
                to = {(PMTU_BACKEND.addr, PMTU_BACKEND.port)}
                for h, hook in enumerate(HOOKS):
                    sport = client[1] + h
                    syn = tcp(client[0], sport, vip, port, SYN)
                    with netns(ns):
                        timed_cell(f"pmtu flow {hook}", k, k.fd[hook], prebuilt([syn]), hook=hook, last=syn,
                                   to=to, snat=NODE_IP, hits="new")
                        for name, size, df in PMTU_ROWS:
                            est = tcp(client[0], sport, vip, port, ACK, payload=b"x" * (size - 54), df=df)
                            cells.setdefault((name, hook), []).append(
                                timed_cell(f"pmtu {name} {hook}", k, k.fd[hook], prebuilt([est] * calls),
                                           hook=hook, last=est, to=to, snat=NODE_IP, hits="ct_fwd"))
            bar.update(1)
    return [{"packet": name, "hook": hook, "ns": Spread.of(cells[(name, hook)])}
            for hook in HOOKS for name, _, _ in PMTU_ROWS]


def path_mtu_table(rows: list[dict]) -> str:
    base = {r["hook"]: r["ns"].median for r in rows if "no DF" in r["packet"]}
    out = ["| masqueraded flow, established | hook | ns per packet | over the same frame without DF |",
           "|---|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['packet']} | {r['hook']} | {r['ns'].fmt()} | {r['ns'].median / max(base[r['hook']], 1):.2f}x |")
    return "\n".join(out)


# --- kernel primitives --------------------------------------------------------------------

def primitives(ref: Reference, calls: int) -> dict[str, float]:
    """ns of single kernel primitives (XDP), over the empty program, same method."""
    pkt = tcp("10.0.0.1", 1, "10.0.0.2", 80)
    bufs = prebuilt([pkt] * calls)
    base = time_frames(ref.empty["xdp"], bufs).median
    return {name: time_frames(ref.fd(fn), bufs).median - base
            for name, fn in (("helper call (clock)", b"prim_clock"), ("coarse clock", b"prim_coarse"),
                             ("hash lookup + helper", b"prim_lookup"), ("LRU lookup, miss", b"prim_lru_miss"),
                             ("hash insert, new key", b"prim_insert"), ("LRU insert, new key", b"prim_lru_insert"),
                             ("8 x 64-bit modulo", b"prim_mod8"), ("8 x multiply and shift", b"prim_range8"))}


# --- main ------------------------------------------------------------------------------------

def machine_notes() -> str:
    try:
        srso = Path("/sys/devices/system/cpu/vulnerabilities/spec_rstack_overflow").read_text().strip()
    except OSError:
        srso = "unknown"
    return f"kernel {os.uname().release}, {os.cpu_count()} CPUs, spec_rstack_overflow: {srso}"


def to_json(obj):
    if isinstance(obj, Spread):
        return {"median": obj.median, "min": obj.lo, "max": obj.hi}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    return obj


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10000, help="frames per cell and round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="kxlb/Katran rounds (default %(default)s)")
    ap.add_argument("--rounds-kxlb", type=int, default=3,
                    help="rounds of the kxlb-only tables (default %(default)s)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="service counts, comma-separated")
    ap.add_argument("--katran", type=Path, default=katran.DEFAULT_ANCHOR, help="the anchor's katran_bench.py")
    ap.add_argument("--no-katran", action="store_true", help="kxlb only (no ratios)")
    ap.add_argument("--only", choices=("versus", "scaling", "variants", "pmtu", "primitives"), action="append",
                    help="run only these sections (repeatable)")
    ap.add_argument("--rev", help="measure bpf/ and loader/ as committed at this git revision, not the checkout's")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    if a.calls < 1 or a.rounds < 1 or not 1 <= a.rounds_kxlb <= 10:
        ap.error("--calls and --rounds must be at least 1, --rounds-kxlb 1 to 10")
    if a.calls > 25_000:
        ap.error("--calls: at most 25000 (a kxlb round makes 4 x calls flows, 8 x calls conntrack entries of 262,144)")
    sizes = [int(s) for s in a.sizes.split(",")]
    sections = set(a.only or ("versus", "scaling", "variants", "pmtu", "primitives"))
    anchor = None
    if "versus" in sections and not a.no_katran:
        try:
            katran.check_prerequisites(a.katran)
        except katran.AnchorMissing as exc:
            print(f"prog_run: {exc}", file=sys.stderr)
            return 2
        katran.check_same_frames(a.katran)
        anchor = a.katran
    steps = (a.rounds * 2 * ("versus" in sections) + len(sizes) * a.rounds_kxlb * ("scaling" in sections)
             + a.rounds_kxlb * ("variants" in sections) + a.rounds_kxlb * ("pmtu" in sections))
    t0 = time.monotonic()
    results: dict = {"machine": machine_notes(), "date": time.strftime("%Y-%m-%d"), "calls": a.calls}
    rev = os.environ.get("KXLB_BENCH_REV")
    results["source"] = f"git {rev} ({MAIN_SOURCE.parent})" if rev else "the checkout"
    source, ref = MAIN_SOURCE, Reference()
    phases = {"versus": lambda: head_to_head(source, ref, anchor, a.calls, a.rounds, bar),
              "scaling": lambda: scaling(source, ref, sizes, a.calls, a.rounds_kxlb, bar),
              "variants": lambda: variants(source, a.calls, a.rounds_kxlb, bar),
              "pmtu": lambda: path_mtu(source, a.calls, a.rounds_kxlb, bar),
              "primitives": lambda: primitives(ref, a.calls)}
    took = {}
    with tqdm(total=steps, desc="prog_run rounds", unit="round", file=sys.stderr) as bar:
        for name, fn in phases.items():
            if name in sections:
                t = time.monotonic()
                results[name] = fn()
                took[name] = time.monotonic() - t
    spread = "median [min-max] of {r} rounds, each round the median of {n} packets"
    if "versus" in sections:
        print(f"kxlb and Katran's balancer, XDP, the same frames: one VIP {katran.VIP}:{katran.VIP_PORT}/tcp, "
              f"3 backends; ns per packet, {spread.format(r=a.rounds, n=a.calls)}, kxlb and Katran rounds "
              f"interleaved (ratios per round); targets from issue 26")
        print(head_to_head_table(results["versus"]))
    if "scaling" in sections:
        print(f"\nkxlb, 1 to {max(sizes):,} services: ns per packet, {spread.format(r=a.rounds_kxlb, n=a.calls)} "
              f"({results['scaling'][0]['new_flow_frames']} for new flows)")
        print(scaling_table(results["scaling"]))
    if "variants" in sections:
        print(f"\nkxlb, other frontends and options of one service port: {spread.format(r=a.rounds_kxlb, n=a.calls)} "
              f"({results['variants'][0]['new_flow_frames']} for new flows)")
        print(variants_table(results["variants"]))
        for note in NOTES:
            print(f"note: {note}")
    if "pmtu" in sections:
        print(f"\nkxlb, the path MTU check of masqueraded packets (a route lookup, in a namespace with forwarding "
              f"on): {spread.format(r=a.rounds_kxlb, n=a.calls)}")
        print(path_mtu_table(results["pmtu"]))
    if "primitives" in sections:
        print("\nkernel primitives on this machine (ns over the empty program, same method):")
        for name, ns in results["primitives"].items():
            print(f"  {name:24} {ns:6.0f}")
    print(f"\n{results['machine']}; bpf/ and loader/ from {results['source']}; {time.monotonic() - t0:.0f} s "
          f"({', '.join(f'{n} {t:.0f} s' for n, t in took.items())})")
    results["notes"], results["seconds"] = NOTES, took
    if a.json:
        Path(a.json).write_text(json.dumps(to_json(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
