"""lab/e2e.py's report: the table of spec x proxy, and its place in docs/e2e.md. (The JUnit
parser is exercised on upstream's own report by tests/lab/test_kubelet_lab.py.)"""
from __future__ import annotations

import json

from kxlb.lab import e2e


RESULTS = {
    "kube-proxy": {"spec a": {"state": "passed", "reason": "", "seconds": 3.0},
                   "spec b": {"state": "skipped", "reason": "Only supported for providers [gce]", "seconds": 0.1}},
    "kxlb": {"spec a": {"state": "failed", "reason": "service is not reachable", "seconds": 120.0},
             "spec b": {"state": "skipped", "reason": "Only supported for providers [gce]", "seconds": 0.1}},
}


def test_table_has_a_row_per_spec_a_column_per_proxy_and_every_reason():
    text = e2e.markdown(RESULTS, "services", {"k8s_version": "v1.37.1", "nodes": 2})
    assert "| spec | kube-proxy | kxlb |" in text
    assert "| spec a | pass (3s) | **FAIL** |" in text
    assert "| spec b | skip | skip |" in text
    assert "- kxlb, *spec a*: service is not reachable" in text
    assert "- kube-proxy, *spec b*: Only supported for providers [gce]" in text
    assert "kube-proxy: 1/2 passed, kxlb: 0/2 passed" in text
    for regex, why in e2e.SKIPS:
        assert f"`{regex}`: {why}" in text


def test_write_table_replaces_only_its_suites_block(tmp_path):
    doc = tmp_path / "e2e.md"
    doc.write_text("# prose\n<!-- e2e:conformance:begin -->\nold\n<!-- e2e:conformance:end -->\n"
                   "<!-- e2e:services:begin -->\nkept\n<!-- e2e:services:end -->\nend\n")
    e2e.write_table(doc, "conformance", "new table\n")
    text = doc.read_text()
    assert "old" not in text and "new table" in text and "kept" in text
    assert text.startswith("# prose\n") and text.endswith("end\n")
    e2e.write_table(tmp_path / "fresh.md", "services", "t\n")
    assert (tmp_path / "fresh.md").read_text() == "<!-- e2e:services:begin -->\nt\n<!-- e2e:services:end -->\n"


def test_a_one_proxy_run_keeps_the_other_proxys_results_of_the_same_binary(tmp_path):
    path = tmp_path / "services.json"
    meta = {"binary": "/cache/e2e/v1.37.1-abc/bin/e2e.test"}
    e2e_json = {"meta": meta, "results": RESULTS}
    path.write_text(json.dumps(e2e_json))
    rerun = {"kxlb": {"spec a": {"state": "passed", "reason": "", "seconds": 2.0}}}
    merged = e2e.merge_earlier(path, rerun, meta)
    assert list(merged) == ["kube-proxy", "kxlb"]
    assert merged["kube-proxy"] == RESULTS["kube-proxy"] and merged["kxlb"] == rerun["kxlb"]
    # another binary's results are not this run's: nothing is merged
    assert e2e.merge_earlier(path, rerun, {"binary": "/cache/e2e/v1.37.1-def/bin/e2e.test"}) == rerun
    assert e2e.merge_earlier(tmp_path / "none.json", rerun, meta) == rerun
