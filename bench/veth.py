"""The tc hook's cost for traffic that is not a service's: one TCP stream (iperf3) through
veths on which kxlb's tc programs are attached (ingress and egress, as the loader attaches
them), against the same veths with no program, in interleaved rounds of one run.

Namespaces of this run only, with no route out of them:

    peer 10.202.0.2 (eth0) ~~ hk0 [node 10.202.0.1, 10.202.1.1] hk1 ~~ (eth0) 10.202.1.2 far

hk0 and hk1 are the node's hooked veths, as a node's pod veths are. The paths, by where
the stream's data segments meet a hook:

- ingress: peer -> node, data at hk0's ingress (ACKs at its egress): a pod sending to a
  process of the node;
- egress: node -> peer, data at hk0's egress (ACKs at its ingress): a process of the
  node sending to a pod;
- forwarded: peer -> far through the node, data at hk0's ingress and hk1's egress: pod to
  pod through the node.

The veths keep their defaults (TSO, scatter-gather, MTU 1500): a data segment is an skb
of up to 64 KB with its headers linear and its payload in pages, the kind kxlb 0.1 pulled.

Variants, each attached on both veths in its turn:

- none: no program and no clsact qdisc, what the veths have on a node without kxlb;
- kxlb: this checkout's datapath (bpf/kxlb.c), loaded by the loader (`datapath.load`);
- kxlb-pull: the same source built with -DKXLB_PULL_ALWAYS, kxlb 0.1's linear pull (192
  bytes of every non-linear skb, bpf/kxlb.c tc_linear_ethertype) and nothing else changed;
- kxlb-0.1.0 (with --release): the released 0.1.0 (tests/oldrelease.py, from git), loaded
  by its own `kxlb load`: the whole old datapath, not just its pull.

One service (10.96.0.10:80, not on these paths) is programmed in each kxlb variant, so the
stream is a node's non-service traffic with a service table present. Every variant is
loaded once; the rounds then move its pinned programs on and off the veths with the
loader's own tc attach (attach.attach_tc, ingress and egress). A round runs every path,
and on each path every variant once, in an order rotated from round to round; each run is
`iperf3 -t SECONDS -O 1` (the first second omitted: slow start), client and server pinned
to one CPU with taskset as bench/e2e.py does, so the figure is what one core moves. Before
a run the bench checks that the veths carry exactly that variant's programs (or none);
after a run of this checkout's builds, that their ingress program counted the stream.

Measured per run, reported per path and variant as the median over the rounds [min-max],
and as the ratio to none taken within each round (the none run of the same round), median
[min-max]:

- Gbit/s: iperf3's received rate;
- Gbit per CPU-second: every byte of the run over the CPU time of the stream's tasks
  (client, server, and the CPU's ksoftirqd; with no IRQ time accounting, a task's run time
  includes the softirqs it ran, where the veth's receive side runs). It is the rate the
  stream would have with the core to itself: other work on a shared machine takes the core
  away (which moves Gbit/s) but not the CPU the stream needs per byte.

Then, unless --no-prog-time, the programs' own time (BPF run-time statistics, enabled
only for these runs: they add two clock reads to every program run, so the rounds run
without them): ns per run of the ingress and egress programs and their share of the
stream's CPU time, per path and kxlb variant (--prog-time-runs runs each, medians). That
share is what the programs cost, measured inside the kernel and not subject to the
machine's noise; the tc hook's cost besides (the clsact qdisc, the classifier call) and
the programs' effect on the caches are in the ratios only.

The target (issue: the tc hook's overhead for non-service traffic within 3% of no
program) is a median kxlb/none ratio of at least 0.97. `--json FILE` writes every run.

Leftovers of a crashed run (namespaces, their iperf3 processes, pins under
/sys/fs/bpf/kxl<PID>x<N>) are removed at the start when their creator is gone; iperf3
dies with the bench (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PATHS = ("ingress", "egress", "forwarded")
PATH_LABELS = {"ingress": "peer -> node: data at hk0 ingress",
               "egress": "node -> peer: data at hk0 egress",
               "forwarded": "peer -> far: data at hk0 ingress, hk1 egress"}
VARIANTS = ("none", "kxlb", "kxlb-pull")
RELEASE = "kxlb-0.1.0"
PULL_CFLAGS = ["-DKXLB_PULL_ALWAYS"]
TARGET = 0.97            # kxlb / none: within 3% of no program
HOOKED = ("hk0", "hk1")
NS_ROLES = ("node", "peer", "far")
NS_RE = re.compile(r"kxl(\d+)x\d+-v(?:node|peer|far)")
ADDR = {"peer": "10.202.0.2", "node0": "10.202.0.1", "node1": "10.202.1.1", "far": "10.202.1.2"}
STREAMS = {"ingress": ("peer", "node", ADDR["node0"]),      # client's namespace, server's, its address
           "egress": ("node", "peer", ADDR["peer"]),
           "forwarded": ("peer", "far", ADDR["far"])}
IPERF_PORT = 5201
SERVICE = ("10.96.0.10", 80)
BACKENDS = ("10.202.9.1:8080", "10.202.9.2:8080")   # addresses on none of the paths
METRICS = {"gbit_s": "Gbit/s", "gbit_per_cpu_s": "Gbit per CPU-second"}


# --- pure logic (tests/test_bench_veth.py) ------------------------------------------------

def order(variants: list[str], rnd: int) -> list[str]:
    """The variants' order in round ``rnd``: rotated by one each round, so that over
    len(variants) rounds each runs once in every position."""
    k = rnd % len(variants)
    return list(variants[k:]) + list(variants[:k])


def iperf_result(out: str) -> dict:
    """From ``iperf3 -J`` (the client's): Gbit/s received (the omitted first second is
    not in iperf3's sums), every byte sent including that second (what the CPU time of
    the whole run moved), and the sender's retransmits. Raises on iperf3's own error."""
    res = json.loads(out)
    if "error" in res:
        raise RuntimeError(f"iperf3: {res['error']}")
    end = res["end"]
    return {"gbit_s": end["sum_received"]["bits_per_second"] / 1e9,
            "bytes_all": sum(i["sum"]["bytes"] for i in res["intervals"]),
            "retransmits": end["sum_sent"].get("retransmits", 0)}


@dataclass
class Cell:
    """One path, variant and metric over the rounds."""
    values: list[float] = field(default_factory=list)                 # by round
    ratio: list[float] = field(default_factory=list)                  # to none, by round


def summarise(runs: list[dict], metric: str) -> dict[str, dict[str, Cell]]:
    """{path: {variant: Cell}} of ``metric`` from the runs ({round, path, variant,
    metric...}): the ratio to none is taken within each round that has both."""
    by = {(r["round"], r["path"], r["variant"]): r[metric] for r in runs}
    out: dict[str, dict[str, Cell]] = {}
    for (rnd, path, variant), x in sorted(by.items()):
        cell = out.setdefault(path, {}).setdefault(variant, Cell())
        cell.values.append(x)
        none = by.get((rnd, path, "none"))
        if variant != "none" and none:
            cell.ratio.append(x / none)
    return out


def spread(xs: list[float], fmt: str) -> str:
    """"median [min-max]" of xs."""
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]" if xs else "-"


def verdict(cells: dict[str, Cell]) -> str:
    """Against the target: met or missed, and kxlb's median difference from none."""
    k = cells.get("kxlb")
    if not k or not k.ratio:
        return ""
    r = statistics.median(k.ratio)
    return f"{'met' if r >= TARGET else 'missed'} ({(r - 1) * 100:+.1f}%)"


def table(summary: dict[str, dict[str, Cell]], variants: list[str], metric: str) -> str:
    """A markdown table of one metric: every variant, the ratios to none, the target."""
    others = [v for v in variants if v != "none"]
    head = ["path"] + [f"{v} {METRICS[metric]}" for v in variants] + [f"{v} / none" for v in others] + \
           [f"kxlb / none >= {TARGET}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + ":-:|"]
    for path in PATHS:
        cells = summary.get(path)
        if not cells:
            continue
        row = [PATH_LABELS[path]] + [spread(cells[v].values if v in cells else [], ".2f") for v in variants]
        row += [spread(cells[v].ratio if v in cells else [], ".3f") for v in others]
        lines.append("| " + " | ".join(row + [verdict(cells)]) + " |")
    return "\n".join(lines)


def prog_time_table(rows: list[dict], variants: list[str]) -> str:
    """The programs' own time: ({path, variant, ingress_ns, ingress_runs, egress_ns,
    egress_runs, prog_s, cpu_s, seconds} per run) -> per path and variant, medians."""
    lines = ["| path | variant | ingress ns per run (runs/s) | egress ns per run (runs/s) | "
             "programs' share of the stream's CPU time |", "|---|---|---:|---:|---:|"]
    med = statistics.median
    for path in PATHS:
        for v in variants:
            rs = [r for r in rows if r["path"] == path and r["variant"] == v]
            if not rs:
                continue
            hooks = [f"{med(r[f'{h}_ns'] for r in rs):.0f} "
                     f"({med(r[f'{h}_runs'] / r['seconds'] for r in rs) / 1e3:.1f}k)" for h in ("ingress", "egress")]
            share = spread([r["prog_s"] / r["cpu_s"] * 100 for r in rs], ".2f")
            lines.append(f"| {PATH_LABELS[path]} | {v} | {hooks[0]} | {hooks[1]} | {share} % |")
    return "\n".join(lines)


# --- namespaces and processes -----------------------------------------------------------

def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench dies (PR_SET_PDEATHSIG survives
    the exec chain ip netns exec -> taskset -> iperf3), so no iperf3 outlives a crash."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def cleanup_stale() -> list[str]:
    """Processes in, then namespaces of, a bench run whose process is gone; then the
    netlab's own cleanup (kxl* namespaces and pin directories of dead runs)."""
    from kxlb.lab.netlab import cleanup_stale as netlab_cleanup
    from kxlb.lab.procs import alive

    removed = []
    for ns in sh("ip", "netns", "list").stdout.split():
        m = NS_RE.fullmatch(ns)
        if m and not alive(int(m.group(1))):
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed + netlab_cleanup()


def run_ns(pid: int) -> int:
    """A task's run time so far, ns (/proc/PID/schedstat)."""
    return int(open(f"/proc/{pid}/schedstat").read().split()[0])


def ksoftirqd(cpu: str) -> int:
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if open(f"/proc/{d}/comm").read().strip() == f"ksoftirqd/{cpu}":
                    return int(d)
            except OSError:
                pass
    raise RuntimeError(f"no ksoftirqd/{cpu}")


class Lab:
    """The three namespaces and the pin directory of one run (names carry our PID)."""

    def __init__(self):
        from kxlb.lab.netlab import unique_tag

        self.tag = unique_tag()
        self.ns = {role: f"{self.tag}-v{role}" for role in NS_ROLES}
        self.pin_root = f"/sys/fs/bpf/{self.tag}"
        self.servers: dict[str, subprocess.Popen] = {}

    def up(self) -> "Lab":
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        node = self.ns["node"]
        sh("ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for dev, peer, mine, theirs in (("hk0", "peer", ADDR["node0"], ADDR["peer"]),
                                        ("hk1", "far", ADDR["node1"], ADDR["far"])):
            sh("ip", "-n", node, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", self.ns[peer])
            sh("ip", "-n", node, "addr", "add", f"{mine}/24", "dev", dev)
            sh("ip", "-n", self.ns[peer], "addr", "add", f"{theirs}/24", "dev", "eth0")
            sh("ip", "-n", node, "link", "set", dev, "up")
            sh("ip", "-n", self.ns[peer], "link", "set", "eth0", "up")
            sh("ip", "-n", self.ns[peer], "route", "add", "10.202.0.0/16", "via", mine)
        return self

    def down(self) -> None:
        for p in self.servers.values():
            p.kill()
            p.wait()
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.pin_root, ignore_errors=True)  # every variant's pins

    def start_servers(self, cpu: str) -> None:
        """iperf3 -s in every namespace that receives a stream, pinned to ``cpu``."""
        for role in NS_ROLES:
            self.servers[role] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[role], "taskset", "-c", cpu, "iperf3", "-s", "-p", str(IPERF_PORT)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def stream(self, path: str, cpu: str, seconds: float) -> dict:
        """One iperf3 run on ``path``: its result (iperf_result), and the CPU time of the
        whole run: client (its rusage), server and the CPU's ksoftirqd (their run time)."""
        client, server, addr = STREAMS[path]
        others = [self.servers[server].pid, ksoftirqd(cpu)]
        for attempt in range(50):  # the servers listen within a moment of their start
            r0, t0, w0 = resource.getrusage(resource.RUSAGE_CHILDREN), [run_ns(p) for p in others], time.monotonic()
            out = subprocess.run(["ip", "netns", "exec", self.ns[client], "taskset", "-c", cpu, "iperf3", "-c",
                                  addr, "-p", str(IPERF_PORT), "-t", f"{seconds:g}", "-O", "1", "-J"],
                                 capture_output=True, text=True, timeout=seconds + 60, preexec_fn=_die_with_parent)
            r1, t1, w1 = resource.getrusage(resource.RUSAGE_CHILDREN), [run_ns(p) for p in others], time.monotonic()
            try:
                res = iperf_result(out.stdout)
            except (RuntimeError, ValueError) as exc:
                if "refused" not in str(exc) or attempt == 49:
                    raise RuntimeError(f"{path}: {exc} {out.stderr.strip()}") from None
                time.sleep(0.1)
                continue
            cl = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            srv, softirq = ((b - a) / 1e9 for a, b in zip(t0, t1))
            res.update(cpu_client_s=cl, cpu_server_s=srv, cpu_softirqd_s=softirq, wall_s=w1 - w0,
                       gbit_per_cpu_s=res["bytes_all"] * 8 / 1e9 / (cl + srv + softirq))
            return res
        raise AssertionError("unreachable")


# --- the variants' programs --------------------------------------------------------------

@dataclass
class Programs:
    """A variant's pinned tc programs (fds), and whether its counters can be read."""
    name: str
    pin_dir: str
    ingress: int
    egress: int
    counted: bool          # this checkout's layout: its dp_stats can be read


def _program_service(pin_dir: str) -> None:
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    with Maps.open(pin_dir) as maps:
        ServiceTable(maps).add(ServiceKey(*SERVICE, 6), [Backend(b.split(":")[0], int(b.split(":")[1]))
                                                         for b in BACKENDS])


def load_variant(lab: Lab, name: str, release_path: Path | None = None) -> Programs:
    """Compile and load a variant as its loader does (attached on both veths), program
    its service, then take its programs off the veths: the rounds attach them."""
    from kxlb.loader import attach, datapath
    from kxlb.loader.compile import pinned_datapath

    pin = f"{lab.pin_root}/{name.replace('.', '_')}"
    ns = lab.ns["node"]
    if name == RELEASE:
        import oldrelease  # tests/ (main() puts it on the path)

        os.makedirs(lab.pin_root, mode=0o700, exist_ok=True)
        kxlb01 = lambda *args: subprocess.run(oldrelease.command(release_path, "--pin-dir", pin, *args),  # noqa: E731
                                              capture_output=True, text=True)
        r = kxlb01("load", *sum((["--iface", i] for i in HOOKED), []), "--netns", ns)
        if r.returncode == 0:
            r = kxlb01("service", "add", f"{SERVICE[0]}:{SERVICE[1]}/tcp", *BACKENDS)
        if r.returncode != 0:
            raise RuntimeError(f"kxlb 0.1.0: {r.stderr.strip() or r.stdout.strip()}")
    else:
        datapath.load(list(HOOKED), ns, pin_dir=pin, extra_cflags=PULL_CFLAGS if name == "kxlb-pull" else None)
        _program_service(pin)
    for iface in HOOKED:
        attach.detach_tc(ns, iface)
    dp = pinned_datapath(pin)  # the same pin names in 0.1.0
    os.close(dp.xdp_fd)
    return Programs(name, pin, dp.tc_fd, dp.tc_egress_fd, counted=name != RELEASE)


def tc_programs(ns: str, iface: str) -> dict:
    """Program ids on each clsact direction of ``iface`` (bpftool), and "qdisc": whether
    it has a clsact qdisc at all."""
    net = json.loads(sh("ip", "netns", "exec", ns, "bpftool", "-j", "net", "show", "dev", iface).stdout)[0]
    out: dict = {d: [t["id"] for t in net["tc"] if t.get("kind") == f"clsact/{d}"] for d in ("ingress", "egress")}
    qdiscs = json.loads(sh("tc", "-n", ns, "-j", "qdisc", "show", "dev", iface).stdout or "[]")
    out["qdisc"] = any(q.get("kind") == "clsact" for q in qdiscs)
    return out


def put_on(lab: Lab, progs: Programs | None) -> None:
    """Exactly ``progs`` on both veths' ingress and egress (None: no program, no clsact)."""
    from kxlb.loader import attach

    ns = lab.ns["node"]
    for iface in HOOKED:
        if progs is None:
            attach.detach_tc(ns, iface)
            want = {"ingress": [], "egress": [], "qdisc": False}
        else:
            attach.attach_tc(ns, iface, progs.ingress)
            attach.attach_tc(ns, iface, progs.egress, "egress")
            want = {"ingress": [attach.prog_ref(progs.ingress).id], "egress": [attach.prog_ref(progs.egress).id],
                    "qdisc": True}
        got = tc_programs(ns, iface)
        if got != want:
            raise RuntimeError(f"{iface}: programs {got}, expected {want} ({progs.name if progs else 'none'})")


def passed(progs: Programs) -> int:
    """The datapath's count of packets passed as not its own (its ingress program's)."""
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import ServiceTable

    with Maps.open(progs.pin_dir) as maps:
        return ServiceTable(maps).datapath_counters()["pass"]


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program, from bpftool (0, 0 with statistics off)."""
    from kxlb.loader.attach import prog_ref

    j = json.loads(sh("bpftool", "-j", "prog", "show", "id", str(prog_ref(fd).id)).stdout)
    return j.get("run_time_ns", 0), j.get("run_cnt", 0)


def measured(lab: Lab, progs: Programs | None, path: str, cpu: str, seconds: float) -> dict:
    """One checked run of a variant on a path."""
    put_on(lab, progs)
    before = passed(progs) if progs and progs.counted else None
    res = lab.stream(path, cpu, seconds)
    if before is not None and passed(progs) - before < 100:
        raise RuntimeError(f"{progs.name} on {path}: its ingress program did not count the stream")
    return res


# --- main ------------------------------------------------------------------------------------

def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "?")
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return f"{os.cpu_count()} cores ({model}), {mem / 2**20:.1f} GiB, Linux {os.uname().release}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="rounds (default %(default)s)")
    ap.add_argument("--seconds", type=int, default=2, help="iperf3 seconds per run, after 1 omitted "
                    "(default %(default)s)")
    ap.add_argument("--paths", default=",".join(PATHS), help="some of %(default)s")
    ap.add_argument("--no-pull", action="store_true", help="without the kxlb-pull variant (kxlb 0.1's pull)")
    ap.add_argument("--release", action="store_true", help="with the released kxlb 0.1.0 (from git; one more "
                    "compile)")
    ap.add_argument("--no-prog-time", action="store_true", help="without the programs' own time")
    ap.add_argument("--prog-time-runs", type=int, default=3, help="runs per path and variant with BPF statistics "
                    "(default %(default)s)")
    ap.add_argument("--cpu", help="the CPU of client and server (default: the last)")
    ap.add_argument("--json", help="write every run and the summary to this file")
    a = ap.parse_args()
    paths = [p for p in a.paths.split(",") if p]
    if not paths or set(paths) - set(PATHS):
        ap.error(f"--paths: some of {','.join(PATHS)}")
    if a.rounds < 1 or a.seconds < 1:
        ap.error("--rounds and --seconds: at least 1")
    if os.geteuid() != 0:
        raise SystemExit("veth: run as root (namespaces, BPF)")
    for tool in ("iperf3", "bpftool", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"veth: {tool} not found (make setup installs it)")
    variants = [v for v in VARIANTS if not (a.no_pull and v == "kxlb-pull")] + ([RELEASE] if a.release else [])
    cpu = a.cpu or str(os.cpu_count() - 1)

    for left in cleanup_stale():
        print(f"removed a crashed run's {left}")
    lab = Lab()
    runs: list[dict] = []
    prog_rows: list[dict] = []
    tmp = tempfile.TemporaryDirectory(prefix="kxlb-bench-veth-")
    try:
        lab.up()
        release_path = None
        if a.release:
            sys.path.insert(0, str(ROOT / "tests"))
            import oldrelease
            release_path = oldrelease.build(Path(tmp.name))
        progs: dict[str, Programs | None] = {"none": None}
        for v in variants[1:]:
            t0 = time.monotonic()
            progs[v] = load_variant(lab, v, release_path)
            print(f"{v}: loaded in {time.monotonic() - t0:.1f} s", flush=True)
        lab.start_servers(cpu)
        for path in paths:  # untimed: the first stream of a path warms neighbours and caches
            lab.stream(path, cpu, 1)
        for rnd in range(a.rounds):
            for path in paths:
                for v in order(variants, rnd):
                    res = measured(lab, progs[v], path, cpu, a.seconds)
                    runs.append({"round": rnd, "path": path, "variant": v, **res})
                    cpu_s = res["cpu_client_s"] + res["cpu_server_s"] + res["cpu_softirqd_s"]
                    print(f"round {rnd + 1}/{a.rounds} {path:9} {v:10} {res['gbit_s']:6.2f} Gbit/s, "
                          f"{res['gbit_per_cpu_s']:6.2f} Gbit per CPU-s ({cpu_s:.2f} of {res['wall_s']:.2f} s on "
                          f"the CPU, {res['retransmits']} retransmits)", flush=True)
        if not a.no_prog_time:
            from kxlb.loader import bpfsys

            stats_fd = bpfsys.lib().bpf_enable_stats(ctypes.c_int(0))  # BPF_STATS_RUN_TIME, while the fd is open
            if stats_fd < 0:
                raise RuntimeError(f"BPF_ENABLE_STATS: {os.strerror(-stats_fd)}")
            try:
                for rnd in range(a.prog_time_runs):
                    for path in paths:
                        for v in order(variants[1:], rnd):
                            p = progs[v]
                            s0 = [prog_run_stats(p.ingress), prog_run_stats(p.egress)]
                            res = measured(lab, p, path, cpu, a.seconds)
                            s1 = [prog_run_stats(p.ingress), prog_run_stats(p.egress)]
                            (ins, inr), (egs, egr) = ((b[0] - x[0], b[1] - x[1]) for x, b in zip(s0, s1))
                            cpu_s = res["cpu_client_s"] + res["cpu_server_s"] + res["cpu_softirqd_s"]
                            prog_rows.append({"path": path, "variant": v, "ingress_ns": ins / max(inr, 1),
                                              "ingress_runs": inr, "egress_ns": egs / max(egr, 1), "egress_runs": egr,
                                              "prog_s": (ins + egs) / 1e9, "cpu_s": cpu_s,
                                              "seconds": res["wall_s"], "gbit_s": res["gbit_s"]})
                            print(f"program time {rnd + 1}/{a.prog_time_runs} {path:9} {v:10} ingress "
                                  f"{ins / max(inr, 1):5.0f} ns x {inr}, egress {egs / max(egr, 1):5.0f} ns x {egr}: "
                                  f"{(ins + egs) / 1e7 / cpu_s:.2f}% of {cpu_s:.2f} CPU-s", flush=True)
            finally:
                os.close(stats_fd)
        put_on(lab, None)
    finally:
        lab.down()
        tmp.cleanup()
    rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    print(f"\nOne TCP stream (iperf3 -t {a.seconds} -O 1, client and server on CPU {cpu}) through veths with "
          f"kxlb's tc programs on ingress and egress, and with none; {machine()}; kxlb {rev}; median [min-max] "
          f"over {a.rounds} rounds, ratios to none taken within each round.")
    summaries = {m: summarise(runs, m) for m in METRICS}
    for m, summary in summaries.items():
        print("\n" + table(summary, variants, m))
    if prog_rows:
        print(f"\nThe programs' own time (BPF statistics on; {a.prog_time_runs} runs each, medians; share "
              f"[min-max]):\n\n" + prog_time_table(prog_rows, variants[1:]))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": machine(), "kxlb": rev, "cpu": cpu, "seconds": a.seconds, "rounds": a.rounds, "runs": runs,
            "prog_time": prog_rows,
            "summary": {m: {p: {v: {"values": c.values, "ratio": c.ratio} for v, c in cells.items()}
                            for p, cells in summary.items()} for m, summary in summaries.items()}}, indent=1))


if __name__ == "__main__":
    main()
