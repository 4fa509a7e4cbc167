"""The backend slot allocator (loader/slots.py): runs of the backend array, next fit,
freed runs quarantined. Pure state: no kernel needed."""
from __future__ import annotations

import pytest

from kxlb.loader import slots
from kxlb.loader.errors import KxlbError
from kxlb.loader.slots import SlotRuns


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_runs_named_by_frontends_are_taken_and_the_rest_is_free():
    r = SlotRuns(100, [(10, 5), (1, 3), (40, 0)])
    assert r.used == 8
    assert r.free_runs() == [(4, 6), (15, 85)]
    assert r.alloc(5) == 15          # next fit: after the last run in use, not the hole at 4
    assert r.alloc(60) == 20
    assert r.alloc(10) == 80
    assert r.alloc(10) == 90         # up to the end of the array
    assert r.alloc(6) == 4           # wrapped: the hole at the start
    assert r.used == 99
    with pytest.raises(KxlbError, match=r"backend map full: no run of 1 free slots \(0 of 99 free, the longest run 0\)"):
        r.alloc(1)


def test_slot_zero_is_never_handed_out():
    r = SlotRuns(5)
    assert [r.alloc(1) for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(KxlbError):
        r.alloc(1)


def test_overlapping_runs_are_refused_with_the_slots_named():
    with pytest.raises(KxlbError, match="slots 12-16 overlap"):
        SlotRuns(100, [(10, 5), (12, 5)])


def test_a_freed_run_waits_out_its_quarantine_and_is_joined_with_its_neighbours():
    clock = Clock()
    r = SlotRuns(40, clock=clock)
    a, b, c = r.alloc(10), r.alloc(10), r.alloc(10)
    assert (a, b, c) == (1, 11, 21)
    r.free_run(b, 10)
    r.free_run(a, 10)
    assert r.quarantined == 20 and r.used == 30
    assert r.alloc(9) == 31          # the only space out of quarantine
    assert r.in_use == 39
    clock.now += slots.QUARANTINE_S
    assert r.in_use == 19            # read without an allocation, the quarantine is over
    assert r.alloc(20) == 1          # a and b, joined into one run
    assert r.free_runs() == []
    assert r.used == 39


def test_a_full_array_waits_for_the_oldest_quarantine_rather_than_fail(monkeypatch):
    clock = Clock()
    slept = []

    def sleep(s):
        slept.append(s)
        clock.now += s
    monkeypatch.setattr(slots.time, "sleep", sleep)
    r = SlotRuns(21, clock=clock)
    first = r.alloc(20)
    clock.now += 0.5
    r.free_run(first, 20)
    assert r.alloc(20) == 1
    assert slept == [slots.QUARANTINE_S]


def test_a_run_freed_twice_is_caught():
    clock = Clock()
    r = SlotRuns(50, clock=clock)
    s = r.alloc(5)
    r.free_run(s, 5)
    r.free_run(s, 5)
    clock.now += slots.QUARANTINE_S
    with pytest.raises(AssertionError, match="freed twice"):
        r.alloc(1)
