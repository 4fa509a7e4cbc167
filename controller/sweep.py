"""Pacing the drift check over the full-sync period.

kube-proxy rewrites every rule once a FullSyncPeriod (1 h): a repair of anything changed
behind its back. kxlb's maps are its own record of what it wrote, so the repair is a
check: read back every service port and every frontend entry, and rewrite what differs.
Done in one pass, that read takes seconds at 20k Services (every map of the node), and
every change of the cluster would wait behind it. So the check is spread over the
period: each sync run takes the share of the service ports (and of the frontend entries
read at the cycle's start) that the time elapsed in the cycle calls for. A change waits
behind a few hundred lookups at most; the whole node is still checked once a period.

Pure: the controller owns the lists and the clock; this says which part of them is due.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DriftSweep:
    period: float                 # seconds a cycle takes (the full-sync period)
    start: float | None = None    # when the current cycle started (None: none yet)
    done: float = 0.0             # fraction of the cycle's lists checked

    def checked_all(self, now: float) -> None:
        """A full pass (the first sync's adoption, a repair) checked everything at ``now``:
        the next cycle starts a period later."""
        self.start, self.done = now, 1.0

    def step(self, now: float) -> tuple[bool, float, float]:
        """(new cycle?, lo, hi): check the fraction [lo, hi) of the cycle's lists now. A new
        cycle (the caller takes fresh lists) starts a period after the last one did, or
        now when the runner has been away longer than a period."""
        new = False
        if self.start is None:
            self.start, new = now, True
        elif self.done >= 1.0 and now >= self.start + self.period:
            self.start = self.start + self.period if now < self.start + 2 * self.period else now
            self.done, new = 0.0, True
        lo = self.done
        hi = 1.0 if self.period <= 0 else max(lo, min(1.0, (now - self.start) / self.period))
        self.done = hi
        return new, lo, hi

    @staticmethod
    def part(items, lo: float, hi: float) -> list:
        """The items of a sequence (anything with len() and slices) in the fraction
        [lo, hi): consecutive steps cover it once."""
        n = len(items)
        return items[int(lo * n):int(hi * n)] if hi < 1.0 else items[int(lo * n):]
