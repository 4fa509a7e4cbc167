"""bench/veth.py's own logic: the rotation of the variants over rounds, what it reads from
iperf3's JSON, the ratios taken within a round, and the verdict against the target (no
namespaces or streams here: the measurement runs in `make bench`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import veth  # noqa: E402


def test_every_variant_runs_once_in_every_position():
    variants = ["none", "kxlb", "kxlb-pull"]
    rounds = [veth.order(variants, r) for r in range(3)]
    assert rounds[0] == variants
    for r in rounds:
        assert sorted(r) == sorted(variants)
    for pos in range(3):
        assert sorted(r[pos] for r in rounds) == sorted(variants)
    assert veth.order(variants, 3) == rounds[0]


def iperf_json(intervals, received_bps, retransmits=0):
    return json.dumps({"intervals": [{"sum": {"bytes": b, "omitted": i == 0}} for i, b in enumerate(intervals)],
                       "end": {"sum_received": {"bits_per_second": received_bps, "seconds": 2.0},
                               "sum_sent": {"retransmits": retransmits}}})


def test_iperf_result_counts_the_omitted_second_in_the_bytes_only():
    got = veth.iperf_result(iperf_json([1_000, 2_000, 3_000], 12e9, 4))
    assert got == {"gbit_s": 12.0, "bytes_all": 6_000, "retransmits": 4}


def test_iperf_error_raises_with_its_message():
    with pytest.raises(RuntimeError, match="Connection refused"):
        veth.iperf_result(json.dumps({"error": "unable to connect to server: Connection refused"}))


def run(rnd, path, variant, g):
    return {"round": rnd, "path": path, "variant": variant, "gbit_s": g}


def test_ratios_are_taken_within_each_round():
    runs = [run(0, "egress", "none", 10.0), run(0, "egress", "kxlb", 9.0),
            run(1, "egress", "none", 5.0), run(1, "egress", "kxlb", 5.0),
            run(2, "egress", "kxlb", 8.0)]                       # a round without none: no ratio
    cells = veth.summarise(runs, "gbit_s")["egress"]
    assert cells["none"].values == [10.0, 5.0] and cells["none"].ratio == []
    assert cells["kxlb"].values == [9.0, 5.0, 8.0]
    assert cells["kxlb"].ratio == pytest.approx([0.9, 1.0])       # not 8/7.5 or the medians' 8/7.5


@pytest.mark.parametrize("ratios, want", [([0.97, 0.99, 1.2], "met (-1.0%)"), ([0.95, 0.969, 1.0], "missed (-3.1%)"),
                                          ([0.97], "met (-3.0%)")])
def test_verdict_is_the_median_ratio_against_097(ratios, want):
    assert veth.verdict({"kxlb": veth.Cell(values=[1.0] * len(ratios), ratio=ratios)}) == want


def test_table_has_a_row_per_path_measured_and_a_column_per_variant():
    runs = [run(r, p, v, g) for r in range(2) for p in ("ingress", "forwarded")
            for v, g in (("none", 10.0), ("kxlb", 9.9), ("kxlb-pull", 9.0))]
    text = veth.table(veth.summarise(runs, "gbit_s"), ["none", "kxlb", "kxlb-pull"], "gbit_s")
    lines = text.splitlines()
    assert len(lines) == 4 and veth.PATH_LABELS["egress"] not in text
    assert lines[2].split(" | ")[1:] == ["10.00 [10.00-10.00]", "9.90 [9.90-9.90]", "9.00 [9.00-9.00]",
                                         "0.990 [0.990-0.990]", "0.900 [0.900-0.900]", "met (-1.0%) |"]
