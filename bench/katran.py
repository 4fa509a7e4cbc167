"""Katran's XDP balancer beside kxlb, in the same run: the anchor benchmark
(../shared/anchors/katran/katran_bench.py, see ../shared/anchors/README.md) run unchanged,
one fresh load per round, in a child process.

The anchor programs one VIP, 10.200.1.1:80/tcp, with 3 reals, and times one frame per
BPF_PROG_TEST_RUN call over prebuilt buffers: the empty program, a frame to another
address (pass-through), an established flow (10.9.9.9:40000) and new flows (10.64.x.1
SYN, 10.65.x.1 ACK, a fresh source port each). bench/prog_run.py programs the same
service in kxlb and times the same bytes (bench/frames.py lays frames out as the
anchor does, checked here against the anchor's own builder).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ANCHOR = ROOT.parent / "shared" / "anchors" / "katran" / "katran_bench.py"

VIP, VIP_PORT = "10.200.1.1", 80
REALS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
EST_CLIENT = ("10.9.9.9", 40000)
NON_VIP = "10.200.9.9"
NEW_NETS = {"new_flow_syn": "10.64", "new_flow_ack": "10.65"}  # the anchor's client nets
ROWS = ("empty", "non_vip", "established", "new_flow_syn", "new_flow_ack")  # the anchor's order


class AnchorMissing(RuntimeError):
    pass


def check_prerequisites(anchor: Path) -> None:
    """Raise AnchorMissing naming what is missing (the anchor needs bpftool and
    libbpf.so.1, Debian's bpftool and libbpf1; `make setup` installs both)."""
    if not anchor.is_file():
        raise AnchorMissing(f"Katran anchor benchmark not found at {anchor} (--katran PATH, or --no-katran)")
    for obj in ("balancer.o", "empty.o"):
        if not (anchor.parent / obj).is_file():
            raise AnchorMissing(f"Katran anchor object {anchor.parent / obj} is missing")
    if not shutil.which("bpftool"):
        raise AnchorMissing("bpftool not found: the Katran anchor loads its programs with it (make setup)")
    try:
        ctypes.CDLL("libbpf.so.1")
    except OSError as exc:
        raise AnchorMissing(f"libbpf.so.1 cannot be loaded ({exc}): the Katran anchor needs it (make setup)") from None


def check_same_frames(anchor: Path) -> None:
    """The like-for-like rows rely on kxlb timing the anchor's bytes: compare
    bench/frames.py with the anchor's own frame builder on each row's frame."""
    from frames import ACK, SYN, tcp

    spec = importlib.util.spec_from_file_location("katran_anchor", anchor)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines functions and loads libbpf; runs nothing
    cases = [(*EST_CLIENT, VIP, VIP_PORT, ACK), (*EST_CLIENT, NON_VIP, VIP_PORT, ACK),
             ("10.64.0.1", 1024, VIP, VIP_PORT, SYN), ("10.65.0.1", 51023, VIP, VIP_PORT, ACK)]
    for c in cases:
        if mod.frame(*c) != tcp(*c):
            raise RuntimeError(f"bench/frames.py no longer builds the anchor's frame for {c}: "
                               "the kxlb and Katran rows would not time the same bytes")


def run_round(anchor: Path, calls: int) -> dict[str, float]:
    """One fresh load of Katran's balancer and one median per row (ns)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, str(anchor), "--calls", str(calls), "--json", out.name],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"Katran anchor failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        res = json.loads(Path(out.name).read_text())
    missing = [r for r in ROWS if f"{r}_ns" not in res]
    if missing:
        raise RuntimeError(f"Katran anchor output lacks {missing}: {res}")
    return {r: float(res[f"{r}_ns"]) for r in ROWS}

