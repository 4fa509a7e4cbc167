"""The upstream Kubernetes e2e network tests, run against each service proxy on one
real-kubelet lab (``make e2e``; ``python -m kxlb.lab.e2e --help``).

The binary is upstream's own suite at the lab's release (``lab/k8s/build.sh --e2e``: the
specs of k8s.io/kubernetes/test/e2e/network and the upstream framework). For each proxy
the lab switches the proxy's DaemonSet (deploy/kxlb.yaml, or kubeadm's kube-proxy), runs
the suite, and reads ginkgo's JUnit report. The result is one table, test x proxy, with
the reason of every failure and skip: written as JSON and as markdown (docs/e2e.md).

Suites:
  conformance  the [Conformance] Services specs (what CI runs)
  services     every Services, "Granular Checks: Services" and Conntrack spec, less the
               ones one machine cannot run (SKIPS says which and why)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import controlplane as cpmod
from .cluster import Lab
from .errors import LabError
from .images import ImageError
from .proxies import PROXY_MODES

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = Path("/tmp/kxlb-e2e")
DEFAULT_PROXIES = ("kube-proxy", "kxlb")


@dataclass(frozen=True)
class Suite:
    focus: str
    help: str


SUITES = {
    "conformance": Suite(r"\[sig-network\] Services .*\[Conformance\]", "the Conformance Services specs"),
    "services": Suite(r"\[sig-network\] (Services|Networking Granular Checks: Services|Conntrack) ",
                      "Services, Granular Checks: Services and Conntrack specs"),
}
# What one machine cannot run, and why: never skipped silently, the table lists them.
SKIPS = (
    (r"SCTP", "this kernel has no SCTP sockets (CONFIG_IP_SCTP unset), so no pod can serve it; kxlb's SCTP NAT is tested on frames"),
    (r"\[Disruptive\]", "restarts the API server or the proxy over SSH to the nodes (a cloud provider's)"),
)


def skip_regex() -> str:
    return "|".join(f"(?:{r})" for r, _ in SKIPS)


def e2e_binary(log=print) -> Path:
    """The cached e2e.test (built on first use, like the lab's other binaries)."""
    r = subprocess.run(["bash", str(cpmod.BUILD_SH), "--e2e"], stdout=subprocess.PIPE, text=True)
    if r.returncode:
        raise LabError(f"{cpmod.BUILD_SH} --e2e failed (its output is above)")
    return Path(r.stdout.strip().splitlines()[-1]) / "e2e.test"


def parse_junit(path: Path) -> dict[str, dict]:
    """{spec name: {"state": passed|failed|skipped, "reason": ..., "seconds": ...}} of the
    specs that ran or were skipped by the suite itself (not the ones the focus left out)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("[It] "):
            continue  # suite setup and teardown nodes
        name = re.sub(r"^\[It\] ", "", name)
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            state, reason = "failed", (node.get("message") or node.text or "").strip()
        elif skipped is not None:
            msg = (skipped.get("message") or "").strip()
            if msg in ("", "skipped"):
                continue  # filtered out by focus/skip: not part of this run
            state, reason = "skipped", re.sub(r"^skipped - ", "", msg)
        else:
            state, reason = "passed", ""
        out[name] = {"state": state, "reason": reason.splitlines()[0][:300] if reason else "",
                     "seconds": round(float(case.get("time") or 0), 1)}
    return out


def run_suite(lab: Lab, binary: Path, suite: Suite, report_dir: Path, *, procs: int = 1,
              extra: tuple[str, ...] = (), log=print) -> dict[str, dict]:
    """Run *suite* against the lab's proxy with *procs* parallel ginkgo processes.

    Like upstream's hack/ginkgo-e2e.sh, the ginkgo CLI built beside e2e.test runs it:
    parallel specs run in *procs* processes, then the ``[Serial]`` ones alone. Most
    specs spend their time waiting for pods and endpoints, so processes beyond the
    cores still pay. The framework itself writes the merged JUnit report."""
    report_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(binary.parent / "ginkgo"), f"--procs={procs}", "--timeout=3h", "--no-color",
            "--succinct", f"--focus={suite.focus}", f"--skip={skip_regex()}", str(binary), "--",
            "--provider=local", f"--kubeconfig={lab.kubeconfig}", f"--report-dir={report_dir}",
            # What a provider would say; without it the multi-node specs skip themselves.
            f"--num-nodes={lab.nodes}", *extra]
    t = time.monotonic()
    with open(report_dir / "e2e.log", "w") as out:
        r = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=report_dir)
    junit = report_dir / "junit_01.xml"
    if not junit.exists():
        raise LabError(f"e2e.test wrote no JUnit report (exit {r.returncode}); see {report_dir / 'e2e.log'}")
    results = parse_junit(junit)
    log(f"e2e: {sum(v['state'] == 'passed' for v in results.values())}/{len(results)} passed with "
        f"{lab.proxy} in {time.monotonic() - t:.0f}s (log {report_dir / 'e2e.log'})")
    return results


def markdown(results: dict[str, dict[str, dict]], suite: str, meta: dict) -> str:
    """The table: one row per spec, one column per proxy; failures and skips with reasons."""
    proxies = list(results)
    names = sorted({n for r in results.values() for n in r})
    mark = {"passed": "pass", "failed": "**FAIL**", "skipped": "skip"}
    lines = [f"| spec | {' | '.join(proxies)} |", "|---" * (len(proxies) + 1) + "|"]
    notes = []
    for name in names:
        cells = []
        for p in proxies:
            r = results[p].get(name)
            if r is None:
                cells.append("-")
                continue
            cells.append(mark[r["state"]] + (f" ({r['seconds']:.0f}s)" if r["state"] == "passed" else ""))
            if r["state"] != "passed":
                notes.append(f"- {p}, *{name}*: {r['reason']}")
        lines.append(f"| {name.replace('|', '/')} | {' | '.join(cells)} |")
    totals = ", ".join(f"{p}: {sum(v['state'] == 'passed' for v in results[p].values())}/{len(results[p])} passed"
                       for p in proxies)
    head = [f"### Suite `{suite}` ({totals})", "",
            f"Kubernetes {meta.get('k8s_version')}, e2e.test from {meta.get('binary')}, " +
            (f"kind (a control plane and {meta.get('nodes')} workers, lab/kind.py)" if meta.get("cluster") == "kind"
             else f"{meta.get('nodes')} real-kubelet nodes") + f", run {meta.get('date')}.", ""]
    skipped = ["", "Not run on one machine (`--ginkgo.skip`):", ""] + [f"- `{r}`: {why}" for r, why in SKIPS]
    return "\n".join(head + lines + ([""] + ["Failures and skips:", ""] + notes if notes else []) + skipped) + "\n"


def write_table(path: Path, suite: str, table: str) -> None:
    """Put *table* between the suite's markers in *path* (docs/e2e.md keeps its prose and
    the other suite's table), or append it with markers."""
    begin, end = f"<!-- e2e:{suite}:begin -->", f"<!-- e2e:{suite}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    path.write_text(text)


def merge_earlier(path: Path, results: dict[str, dict], meta: dict) -> dict[str, dict]:
    """*results* plus the other proxies' results of an earlier run of the same binary
    in *path*, so the proxies can be run one at a time (``--proxy kxlb``) into one table."""
    try:
        earlier = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return results
    if earlier.get("meta", {}).get("binary") != meta["binary"]:
        return results
    merged = {**earlier.get("results", {}), **results}
    return dict(sorted(merged.items()))


def run_on_kind(binary: Path, suite: Suite, suite_name: str, out: Path, *, procs: int,
                markdown_to: Optional[str], keep: bool) -> int:
    """The suite against kxlb on the kind cluster (lab/kind.py; up if it is not): its
    table is its own (suite name ``<suite>-kind``), beside the lab's. A cluster this run
    brought up is deleted afterwards unless *keep*; one that was up stays."""
    from .kind import KindCluster

    cluster = KindCluster()
    was_up = cluster.status()["exists"]
    try:
        cluster.up()
        results = {"kxlb": run_suite(cluster, binary, suite, out / f"{suite_name}-kind" / "kxlb", procs=procs)}
        # read while the cluster is up: down() below leaves no node to count
        meta = {"k8s_version": cluster.bins.k8s_version, "binary": str(binary), "nodes": cluster.nodes,
                "date": time.strftime("%Y-%m-%d"), "cluster": "kind"}
    except (LabError, ImageError) as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not (keep or was_up):
            cluster.down()
    return report(out, f"{suite_name}-kind", results, meta, markdown_to)


def report(out: Path, name: str, results: dict[str, dict], meta: dict, markdown_to: Optional[str]) -> int:
    """Write the run's JSON (``out/<name>.json``) and its table (printed, and between
    *name*'s markers in *markdown_to*); 1 if any spec failed."""
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    table = markdown(results, name, meta)
    print(table)
    if markdown_to:
        write_table(Path(markdown_to), name, table)
    return 1 if any(v["state"] == "failed" for r in results.values() for v in r.values()) else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="conformance")
    ap.add_argument("--proxy", action="append", choices=[m for m in PROXY_MODES if m != "none"],
                    help=f"a proxy to run the suite against (repeat; default: {' and '.join(DEFAULT_PROXIES)})")
    ap.add_argument("--workdir", default=str(DEFAULT_WORKDIR), help="the lab's work directory")
    ap.add_argument("--name", default="kxe2e", help="the lab's name (namespace prefix)")
    ap.add_argument("--port-offset", type=int, default=3400)
    ap.add_argument("--nodes", type=int, default=3,
                    help="lab nodes (default 3: the fewest every spec of the suites runs on)")
    ap.add_argument("--out", default=None, help="results directory (default: WORKDIR/results)")
    ap.add_argument("--markdown", default=None,
                    help="also put the table in this file, between the suite's markers (docs/e2e.md)")
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    ap.add_argument("--focus", default=None, help="a regex instead of the suite's focus")
    ap.add_argument("--procs", type=int, default=4,
                    help="parallel ginkgo processes (default 4; [Serial] specs run alone at the end)")
    ap.add_argument("--cluster", choices=("lab", "kind"), default="lab",
                    help="lab: the real-kubelet lab, both proxies (default); kind: the kind cluster of "
                         "`make kind` (lab/kind.py), brought up if it is not, with kxlb only (it has no kube-proxy)")
    args = ap.parse_args(argv)
    proxies = args.proxy or list(DEFAULT_PROXIES)
    suite = SUITES[args.suite] if not args.focus else Suite(args.focus, "custom focus")
    out = Path(args.out or Path(args.workdir) / "results")
    binary = e2e_binary()
    if args.cluster == "kind":
        return run_on_kind(binary, suite, args.suite, out, procs=args.procs, markdown_to=args.markdown,
                           keep=args.keep)
    lab = Lab(args.workdir, name=args.name, nodes=args.nodes, port_offset=args.port_offset, kubelet=True,
              proxy="none")
    results: dict[str, dict] = {}
    try:
        lab.up()
        for p in proxies:
            lab.set_proxy(p, timeout=300)
            results[p] = run_suite(lab, binary, suite, out / args.suite / p, procs=args.procs)
    except LabError as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            lab.down(quiet=True)
    meta = {"k8s_version": (lab.read_state() or {}).get("k8s_version"), "binary": str(binary),
            "nodes": lab.nodes, "date": time.strftime("%Y-%m-%d")}
    results = merge_earlier(out / f"{args.suite}.json", results, meta)
    return report(out, args.suite, results, meta, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
