"""Statistics shared by the benchmarks."""
from __future__ import annotations


def pct(xs: list[float], p: float) -> float:
    """Percentile p (0..100) of xs, the sample nearest the rank p% of the way from the
    smallest to the largest; NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
