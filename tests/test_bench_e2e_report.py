"""bench/e2e_report.py: the ratios to the floor, the tables and the README section it
rewrites, and the plots, from a results.json as bench/e2e.py writes it (no lab here:
the measurements themselves run in `make bench-e2e`)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import e2e_report as rep  # noqa: E402


def row(proxy, services, client_ms, pod_ms, **kw):
    base = {"proxy": proxy, "services": services, "sync_s": None if proxy == "none" else 2.0,
            "client_ms": client_ms, "pod_ms": pod_ms, "client_round_p50": [client_ms[0], client_ms[-1]],
            "pod_round_p50": [pod_ms[0]], "create_ms": [] if proxy == "none" else [30.0, 10.0, 20.0],
            "change_ms": [] if proxy == "none" else [5.0], "rss_mb": 0.0 if proxy == "none" else 40.0,
            "kernel_mb": 0.0 if proxy == "none" else 8.0, "throughput": None}
    return {**base, **kw}


RESULTS = {
    "machine": {"cpu": "test cpu", "cores": 2, "memory_gib": 24.0, "kernel": "6.x", "python": "3.11"},
    "versions": {"kube-proxy": "Kubernetes v1.37.1", "iptables": "iptables v1.8.9", "nftables": "nftables v1.0.6",
                 "iperf3": "iperf 3.12", "kxlb": "abc1234"},
    "rows": [
        row("none", 1, [0.1] * 90 + [0.5] * 10, [0.2] * 100,
            throughput={"gbit_s": 10.0, "kpps": 400.0, "cpu_us_per_packet": 2.0}),
        row("kube-proxy", 1, [0.15] * 90 + [1.0] * 10, [0.3] * 100,
            throughput={"gbit_s": 8.0, "kpps": 320.0, "cpu_us_per_packet": 2.5}, client_failed=2),
        row("none", 1000, [0.1] * 100, [0.2] * 100),
        row("kxlb", 1000, [0.12] * 100, [0.25] * 100, compile_s=12.5),
    ],
}


def test_percentiles():
    xs = list(range(100, 0, -1))
    assert (rep.pct(xs, 0), rep.pct(xs, 99), rep.pct(xs, 100)) == (1, 99, 100)
    assert rep.pct([], 50) != rep.pct([], 50)  # NaN


def test_every_figure_with_a_floor_carries_its_ratio_to_the_floor_of_its_size():
    lines = rep.latency_table(RESULTS["rows"]).splitlines()
    kp = next(x for x in lines if "kube-proxy nftables" in x).split("|")
    assert kp[4].strip() == "0.150 (1.50x) [0.150–1.00]"     # p50 over the floor's 0.1, rounds' spread
    assert kp[5].strip() == "1.00 (2.00x), 2 failed"          # p99 over the floor's p99 (0.5); failures shown
    assert kp[6].strip() == "0.300 (1.50x) [0.300–0.300]" or kp[6].strip() == "0.300 (1.50x)"
    assert kp[8].strip() == "20" and kp[10].strip() == "40 + 8"  # median create, memory
    kx = next(x for x in lines if "kxlb tc" in x).split("|")
    assert kx[4].strip().startswith("0.120 (1.20x)")         # the 1,000-Service floor, not the 1-Service one
    assert kx[3].strip() == "2.00 (12.5)" and kp[3].strip() == "2.00"  # the compile, for kxlb
    floor = next(x for x in lines if "no proxy" in x).split("|")
    assert "x)" not in floor[4] and floor[3].strip() == "–"
    # Services created or changed that never answered: counted beside the median of those that did.
    slow = rep.latency_table([RESULTS["rows"][2], row("kube-proxy-iptables-legacy", 1000, [0.2] * 10, [0.2] * 10,
                                                      create_ms=[61000.0], change_ms=[], change_timeouts=2)])
    cells = slow.splitlines()[-1].split("|")
    assert cells[2].strip() == "kube-proxy iptables-legacy" and cells[8:10] == [" 61000 ", " –, 2 timed out "]
    tp = rep.throughput_table(RESULTS["rows"])
    assert "| 1 | kube-proxy nftables | 8.00 (0.80x) | 320 (0.80x) | 2.50 (1.25x) |" in tp
    # a merged run's throughput at another size: its ratios against that size's floor
    more = [{**r, "services": 1000, "throughput": {"gbit_s": g, "kpps": 100.0, "cpu_us_per_packet": 4.0}}
            for r, g in ((RESULTS["rows"][0], 5.0), (RESULTS["rows"][1], 4.0))]
    tp = rep.throughput_table(RESULTS["rows"] + more)
    assert "| 1,000 | kube-proxy nftables | 4.00 (0.80x) | 100 (1.00x) | 4.00 (1.00x) |" in tp
    assert "| 1 | kube-proxy nftables | 8.00 (0.80x) |" in tp


def test_write_docs_rewrites_only_the_marked_readme_section_and_draws_the_plots(tmp_path):
    (tmp_path / "docs" / "bench-e2e").mkdir(parents=True)
    (tmp_path / "README.md").write_text(f"intro\n{rep.README_BEGIN}\nold table\n{rep.README_END}\nrest\n")
    rep.write_docs(RESULTS, tmp_path / "docs" / "bench-e2e", tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("intro\n") and readme.endswith(f"{rep.README_END}\nrest\n")
    assert "old table" not in readme and "kube-proxy nftables" in readme and "Kubernetes v1.37.1" in readme
    doc = (tmp_path / "docs" / "bench-e2e.md").read_text()
    for name in ("latency.png", "sync.png", "programming.png", "memory.png"):
        assert f"(bench-e2e/{name})" in doc
        assert (tmp_path / "docs" / "bench-e2e" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_keeps_other_sizes_rows_and_notes_but_not_those_of_sizes_measured_again():
    saved = {**RESULTS, "notes": ["kube-proxy iptables-nft at 10,000 Services: no answer", "kxlb XDP at 1 Services: x",
                                  "Machine-wide remark."]}
    sizes_before = sorted({r["services"] for r in saved["rows"]})
    again = sizes_before[-1]
    rows, notes = rep.kept_results(saved, [again, 30000])
    assert rows and {r["services"] for r in rows} == set(sizes_before) - {again}
    want = [n for n in saved["notes"] if not n.startswith(f"kube-proxy iptables-nft at {again:,} Services")]
    assert notes == want
    assert rep.kept_results(saved, [10000])[1] == ["kxlb XDP at 1 Services: x", "Machine-wide remark."]
    # A proxy left out of a run keeps its notes at the sizes measured again (why it has no row).
    assert rep.kept_results(saved, [10000], ["none", "kube-proxy"])[1] == saved["notes"]
    assert rep.kept_results(saved, [10000], ["kube-proxy-iptables"])[1] == saved["notes"][1:]
