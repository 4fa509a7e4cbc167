"""Time a program on prebuilt frames, one BPF_PROG_TEST_RUN call per frame.

One frame per call (repeat=1): with repeat > 1 the kernel runs the program again on
the buffer it has just rewritten (now addressed to a backend), which measures another
path, and a new flow would be new only once. Every frame is copied into its own C
buffer before the first call, and the loop between two calls only points the options
at the next buffer: the same loop as Katran's anchor benchmark, so both are measured
with the same method and the same Python between calls. The kernel's ``duration`` is
the time around the program run alone (no syscall, no copy), in ns.
"""
from __future__ import annotations

import ctypes
import statistics
from dataclasses import dataclass

from kxlb.loader.bpfsys import TestRunOpts, check, lib

OUT_SIZE = 2048  # room for Katran's IPIP encapsulation too; the same for every program


@dataclass
class Timed:
    """One cell of one round: the per-frame durations, and the last call's verdict and
    output frame (so the caller can check the program did what the row claims)."""

    ns: list[int]
    retval: int
    out: bytes

    @property
    def median(self) -> float:
        return statistics.median(self.ns)


def prebuilt(frames: list[bytes]) -> list[ctypes.Array]:
    return [ctypes.create_string_buffer(f, len(f)) for f in frames]


def time_frames(prog_fd: int, bufs: list[ctypes.Array]) -> Timed:
    """Run ``prog_fd`` once on each prebuilt buffer, in order."""
    run = lib().bpf_prog_test_run_opts
    out = ctypes.create_string_buffer(OUT_SIZE)
    o = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_out=ctypes.addressof(out))
    ref, ns = ctypes.byref(o), []
    for b in bufs:
        o.data_in, o.data_size_in, o.data_size_out, o.repeat = ctypes.addressof(b), len(b), OUT_SIZE, 1
        check(run(prog_fd, ref), "BPF_PROG_TEST_RUN")
        ns.append(o.duration)
    return Timed(ns, o.retval, out.raw[: o.data_size_out])


@dataclass
class Spread:
    """A figure over rounds: the median of the rounds' medians, and their min and max."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values))

    def fmt(self, digits: int = 0) -> str:
        return f"{self.median:.{digits}f} [{self.lo:.{digits}f}-{self.hi:.{digits}f}]"
