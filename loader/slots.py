"""Where in a family's backend array each backend set lives (bpf/maps.h backend_map).

A set of n backends is a run of n consecutive slots of the array; a frontend's entry
names the run's first slot (struct svc_value.slots). This module is the allocator of
those runs, pure state (no map I/O), rebuilt from the frontends' entries when a writer
starts: the runs they name are used, everything else is free.

Two rules keep a packet from reading a run after it was given to another set:
- *next fit*: a run is taken from the first free space at or after where the last one
  ended, wrapping only at the end of the array, so a run just freed is the last space
  reused, not the first;
- *quarantine*: a freed run stays unusable for QUARANTINE_S (a packet that read the old
  entry just before the flip is long done by then; a socket hook preempted between its
  two reads is the slowest reader there is).
The datapath checks a third: each slot carries its set's tag (svc_id and generation,
struct backend.tag), and a packet that finds another tag re-reads the frontend.
"""
from __future__ import annotations

import bisect
import itertools
import time
from typing import Callable, Iterable

from .errors import KxlbError

QUARANTINE_S = 2.0
"""Seconds a freed run waits before it can be allocated again."""


class SlotRuns:
    """Runs of slots [start, start + n) in an array of ``capacity`` slots. Slot 0 is never
    handed out: an entry whose run starts at 0 has no backends (a zeroed entry)."""

    def __init__(self, capacity: int, used: Iterable[tuple[int, int]] = (),
                 clock: Callable[[], float] = time.monotonic, what: str = "backend"):
        self.capacity, self.clock, self.what = capacity, clock, what
        self._starts: list[int] = []   # free runs, sorted by start, never adjacent
        self._lens: list[int] = []
        self._quarantine: list[tuple[float, int, int]] = []  # (freed at, start, n), oldest first
        self._cursor = 1
        self.used = 0
        taken = sorted((s, n) for s, n in used if n > 0)
        pos = 1
        for s, n in taken:
            if s < pos or s + n > capacity:
                raise KxlbError(f"{what} slots {s}-{s + n - 1} overlap another set's or lie outside the "
                                f"array of {capacity}")
            if s > pos:
                self._append_free(pos, s - pos)
            pos = s + n
            self.used += n
        if pos < capacity:
            self._append_free(pos, capacity - pos)
        self._cursor = pos if pos < capacity else 1

    def _append_free(self, start: int, n: int) -> None:
        self._starts.append(start)
        self._lens.append(n)

    @property
    def in_use(self) -> int:
        """Slots of live runs, and of freed ones still in quarantine (at most QUARANTINE_S
        old: the ones past it are released first)."""
        self._release(self.clock())
        return self.used

    @property
    def quarantined(self) -> int:
        return sum(n for _, _, n in self._quarantine)

    @property
    def free(self) -> int:
        """Slots allocatable now or once their quarantine ends."""
        return self.capacity - 1 - self.used

    def alloc(self, n: int) -> int:
        """The first slot of a free run of ``n`` (n > 0): next fit from the cursor. Waits
        out a quarantine only when nothing else fits (a full array of churning sets);
        raises KxlbError when no free run is long enough."""
        assert n > 0
        self._release(self.clock())
        start = self._find(n)
        while start is None and self._quarantine:
            time.sleep(max(0.0, self._quarantine[0][0] + QUARANTINE_S - self.clock()))
            self._release(self.clock())
            start = self._find(n)
        if start is None:
            longest = max(self._lens, default=0)
            raise KxlbError(f"{self.what} map full: no run of {n} free slots ({self.free} of "
                            f"{self.capacity - 1} free, the longest run {longest})")
        self._take(start, n)
        self._cursor = start + n if start + n < self.capacity else 1
        self.used += n
        return start

    def _find(self, n: int) -> int | None:
        i = bisect.bisect_right(self._starts, self._cursor) - 1
        # the run holding the cursor (from the cursor on), then every run after it, then
        # from the array's start
        if i >= 0 and self._starts[i] + self._lens[i] - self._cursor >= n:
            return self._cursor
        for j in itertools.chain(range(i + 1, len(self._starts)), range(0, i + 1)):
            if self._lens[j] >= n:
                return self._starts[j]
        return None

    def _take(self, start: int, n: int) -> None:
        i = bisect.bisect_right(self._starts, start) - 1
        s, ln = self._starts[i], self._lens[i]
        assert s <= start and start + n <= s + ln
        del self._starts[i], self._lens[i]
        if start + n < s + ln:
            self._starts.insert(i, start + n)
            self._lens.insert(i, s + ln - start - n)
        if start > s:
            self._starts.insert(i, s)
            self._lens.insert(i, start - s)

    def free_run(self, start: int, n: int) -> None:
        """Give a run back: allocatable after the quarantine."""
        if n <= 0:
            return
        self._quarantine.append((self.clock(), start, n))

    def _release(self, now: float) -> None:
        while self._quarantine and now - self._quarantine[0][0] >= QUARANTINE_S:
            _, start, n = self._quarantine.pop(0)
            self._insert_free(start, n)
            self.used -= n

    def _insert_free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + n > self._starts[i] or \
                i > 0 and self._starts[i - 1] + self._lens[i - 1] > start:
            raise AssertionError(f"{self.what} run {start}+{n} freed twice")
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:   # join the run before
            i -= 1
            start, n = self._starts[i], self._lens[i] + n
            del self._starts[i], self._lens[i]
        if i < len(self._starts) and start + n == self._starts[i]:        # and the one after
            n += self._lens[i]
            del self._starts[i], self._lens[i]
        self._starts.insert(i, start)
        self._lens.insert(i, n)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, n) of every free run (quarantined ones not included), in order."""
        return list(zip(self._starts, self._lens))
