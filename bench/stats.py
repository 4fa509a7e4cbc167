"""Statistics and process measures shared by the benchmarks."""
from __future__ import annotations


def pct(xs: list[float], p: float) -> float:
    """Percentile p (0..100) of xs, the sample nearest the rank p% of the way from the
    smallest to the largest; NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_mb(pid: int) -> float:
    """A process's resident set (VmRSS), MB; 0 if it has none (a kernel thread)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
