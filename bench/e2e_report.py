"""bench/e2e.py's results as tables and plots: pure functions of results.json (no lab),
so a report can be redrawn from a saved run: `python bench/e2e_report.py docs/bench-e2e`."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import median

from stats import pct

LABELS = {"none": "no proxy (floor)", "kube-proxy-iptables": "kube-proxy iptables-nft",
          "kube-proxy-iptables-legacy": "kube-proxy iptables-legacy", "kube-proxy": "kube-proxy nftables",
          "kxlb": "kxlb tc", "kxlb-xdp": "kxlb XDP"}
COLORS = {"none": "0.55", "kube-proxy-iptables": "tab:red", "kube-proxy-iptables-legacy": "tab:purple",
          "kube-proxy": "tab:orange", "kxlb": "tab:blue", "kxlb-xdp": "tab:green"}
README_BEGIN, README_END = "<!-- bench-e2e:begin -->", "<!-- bench-e2e:end -->"


def label(proxy: str) -> str:
    return LABELS.get(proxy, proxy)


def kept_results(saved: dict, sizes: list[int], proxies: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """What `--merge` keeps of a saved run: the rows of the sizes not measured now (each
    size's rows, floor included, come from one run), and the notes except those about a
    proxy and size measured now (such a note starts "<proxy> at <N> Services"; *proxies*
    None: every proxy is measured now)."""
    about = re.compile(r"^(?P<who>[^.]*?) at (?P<n>[\d,]+) Services\b")
    now = None if proxies is None else {label(p) for p in proxies}

    def stale(note: str) -> bool:
        m = about.match(note)
        return bool(m) and int(m["n"].replace(",", "")) in sizes and (now is None or m["who"] in now)

    return ([r for r in saved["rows"] if r["services"] not in sizes],
            [n for n in saved.get("notes", []) if not stale(n)])


def _floor(rows: list[dict], size: int) -> dict | None:
    return next((r for r in rows if r["proxy"] == "none" and r["services"] == size), None)


def _ratio(value: float, floor: float | None) -> str:
    if floor is None or floor != floor or not floor or value != value:
        return ""
    return f" ({value / floor:.2f}x)"


def _ms(x: float) -> str:
    return "–" if x != x else (f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.0f}")


def _failed(n: int | None) -> str:
    return f", {n} failed" if n else ""


def _spread(p50s: list[float]) -> str:
    return f" [{_ms(min(p50s))}–{_ms(max(p50s))}]" if len(p50s) > 1 else ""


def _median_ms(xs: list[float]) -> str:
    return _ms(median(xs)) if xs else "–"


def _timeouts(r: dict) -> str:
    """Created or changed Services that did not answer within --change-timeout."""
    n = r.get("change_timeouts", 0)
    return f", {n} timed out" if n else ""


def latency_table(rows: list[dict], compact: bool = False) -> str:
    head = ("| Services | proxy | start to answering s (compile) | from outside p50 ms [rounds] | p99 ms | from a pod p50 ms [rounds] | p99 ms "
            "| create → answers ms | change → answers ms | memory MB (RSS + kernel) |")
    out = [] if compact else [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = _floor(rows, r["services"]) or {}
        fc, fp = pct(f.get("client_ms", []), 50), pct(f.get("pod_ms", []), 50)
        fc99, fp99 = pct(f.get("client_ms", []), 99), pct(f.get("pod_ms", []), 99)
        c50, c99, p50, p99 = (pct(r["client_ms"], 50), pct(r["client_ms"], 99), pct(r["pod_ms"], 50),
                              pct(r["pod_ms"], 99))
        none = r["proxy"] == "none"
        sync = "–" if none else f"{r['sync_s']:.2f}" + (f" ({r['compile_s']:.1f})" if r.get("compile_s") else "")
        mem = "–" if none else f"{r['rss_mb']:.0f} + {r['kernel_mb']:.0f}"
        out.append(
            f"| {r['services']:,} | {label(r['proxy'])} | {sync} "
            f"| {_ms(c50)}{'' if none else _ratio(c50, fc)}{_spread(r['client_round_p50'])} "
            f"| {_ms(c99)}{'' if none else _ratio(c99, fc99)}{_failed(r.get('client_failed'))} "
            f"| {_ms(p50)}{'' if none else _ratio(p50, fp)}{_spread(r['pod_round_p50'])} "
            f"| {_ms(p99)}{'' if none else _ratio(p99, fp99)}{_failed(r.get('pod_failed'))} "
            f"| {'–' if none else _median_ms(r['create_ms'])} | {'–' if none else _median_ms(r['change_ms'])}"
            f"{_timeouts(r)} "
            f"| {mem} |")
    return "\n".join(out)


def throughput_table(rows: list[dict]) -> str:
    """iperf3 figures of the sizes that have them (the first size of a run), each ratio
    to the floor of its own size."""
    with_tp = [r for r in rows if r.get("throughput")]
    if not with_tp:
        return ""
    out = ["One TCP stream through the Service (iperf3), client and server on one core, with the given number of "
           "Services present. Packets are those of the client's interface (with TSO and GRO, segments of up to "
           "64 KB); CPU is every core's busy time over them.", "",
           "| Services | proxy | Gbit/s | packets/s (k) | CPU µs per packet |", "|---:|---|---:|---:|---:|"]
    for r in with_tp:
        t = r["throughput"]
        none = r["proxy"] == "none"
        floor = _floor(with_tp, r["services"])
        f = floor["throughput"] if floor else None
        out.append(f"| {r['services']:,} | {label(r['proxy'])} "
                   f"| {t['gbit_s']:.2f}{'' if none else _ratio(t['gbit_s'], f and f['gbit_s'])} "
                   f"| {t['kpps']:.0f}{'' if none else _ratio(t['kpps'], f and f['kpps'])} "
                   f"| {t['cpu_us_per_packet']:.2f}{'' if none else _ratio(t['cpu_us_per_packet'], f and f['cpu_us_per_packet'])} |")
    return "\n".join(out)


def render(rows: list[dict], compact: bool = False) -> str:
    t = latency_table(rows, compact)
    return t if compact else t + "\n\n" + throughput_table(rows)


def plots(results: dict, out: Path) -> list[str]:
    """One PNG per series; returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    proxies = list(dict.fromkeys(r["proxy"] for r in rows))
    by = {p: sorted((r for r in rows if r["proxy"] == p), key=lambda r: r["services"]) for p in proxies}
    names = []

    def finish(fig, ax, name: str, ylabel: str, title: str) -> None:
        for a in (ax if isinstance(ax, (list, tuple)) else [ax]):
            a.set_xscale("log")
            a.set_xlabel("Services present (10 endpoints each)")
            a.grid(True, which="both", alpha=0.3)
        (ax[0] if isinstance(ax, (list, tuple)) else ax).set_ylabel(ylabel)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, where in ((axes[0], "client_ms", "from outside (client)"), (axes[1], "pod_ms", "from a pod")):
        for p in proxies:
            xs = [r["services"] for r in by[p]]
            ax.plot(xs, [pct(r[key], 50) for r in by[p]], "o-", color=COLORS.get(p), label=f"{label(p)} p50")
            ax.plot(xs, [pct(r[key], 99) for r in by[p]], "x--", color=COLORS.get(p), alpha=0.6,
                    label=f"{label(p)} p99")
        ax.set_title(where)
    axes[1].legend(fontsize=7, ncol=2)
    finish(fig, [axes[0], axes[1]], "latency.png", "new connection + one request, ms",
           "New-connection latency to the newest Service")

    for name, key, ylabel, title in (
            ("sync.png", "sync_s", "seconds", "Proxy start to the newest Service answering"),
            ("programming.png", "create_ms", "ms (median)", "Service created to answering"),
            ("memory.png", None, "MB (RSS of both nodes' proxies + kernel state)", "Memory of the proxy's state")):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for p in proxies:
            if p == "none":
                continue
            xs = [r["services"] for r in by[p]]
            ys = [r["rss_mb"] + r["kernel_mb"] if key is None else
                  (median(r[key]) if r[key] else float("nan")) if isinstance(r[key], list) else r[key]
                  for r in by[p]]
            ax.plot(xs, ys, "o-", color=COLORS.get(p), label=label(p))
        if key == "sync_s":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        finish(fig, ax, name, ylabel, title)
    return names


def write_docs(results: dict, out: Path, root: Path) -> None:
    """docs/bench-e2e.md (method, machine, tables, plots) and README's table, between
    its markers, both from ``results``."""
    rows = results["rows"]
    names = plots(results, out)
    m, v = results["machine"], results["versions"]
    rel = out.relative_to(root / "docs") if out.is_relative_to(root / "docs") else out
    machine = (f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}; {v['kube-proxy']}, "
               f"{v['iptables']}, {v['nftables']}; kxlb {v['kxlb']}")
    tables = render(rows)
    doc = [
        "# kxlb against kube-proxy, end to end (`make bench-e2e`)", "",
        "Generated by `bench/e2e.py` (do not edit: rerun `make bench-e2e`). Method in the script's docstring and in "
        "[the README](../README.md#benchmarks).", "",
        f"Machine: {machine}. The lab: a real kube-apiserver, etcd, controller-manager and scheduler, two netns "
        "nodes, 10 echo pods; every proxy runs on both nodes in turn, with the same Services present.", "",
        "Ratios are to the no-proxy floor of the same run (the same traffic straight to the pods). "
        "Latency: a new TCP connection, one request and its reply; [a–b] is the range of the rounds' p50s.", "",
        tables, "",
        *[f"- {n}" for n in results.get("notes", [])], "",
        *[f"![{n}]({rel}/{n})" for n in names], "",
    ]
    (root / "docs" / "bench-e2e.md").write_text("\n".join(doc))
    readme = root / "README.md"
    text = readme.read_text()
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
        notes = "".join(f"- {n}\n" for n in results.get("notes", []))
        body = (f"\n{machine}.\n\n{tables}\n\n{notes}{chr(10) if notes else ''}"
                "Plots and the method: [docs/bench-e2e.md](docs/bench-e2e.md).\n")
        readme.write_text(head + README_BEGIN + body + README_END + tail)


if __name__ == "__main__":
    d = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "bench-e2e")
    res = json.loads((d / "results.json").read_text())
    print(render(res["rows"]))
    write_docs(res, d.resolve(), Path(__file__).resolve().parent.parent)
