"""The drift check a piece at a time: ServiceTable.drifted() and stray_entries() against
real pinned maps changed behind a table's back (by a second table, as another tool
would), and the pacing of controller/sweep.py that spreads them over the full-sync
period."""
from __future__ import annotations

import pytest

from harness import clean_table
from kxlb.controller.sweep import DriftSweep
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.services import ServiceTable, _marker_key
from kxlb.loader.svcspec import Frontend, Kind, LbService

A = ServiceKey("10.96.40.1", 80, 6)
B = ServiceKey("10.96.40.2", 53, 17)
C6 = ServiceKey("fd00:96::40:3", 443, 6)
NODE_PORT = Frontend(ServiceKey("192.168.40.10", 30080, 6), Kind.NODE_PORT)


def bs(n: int, base: int = 1, v6: bool = False) -> list[Backend]:
    return [Backend(f"fd00:1::{base + j:x}" if v6 else f"10.1.40.{base + j}", 8080) for j in range(n)]


@pytest.fixture
def table(dp):
    _, maps = dp
    with clean_table(maps) as t:
        yield t


@pytest.fixture
def other(dp):
    """Another writer of the same maps: the record of `table` knows nothing of its writes."""
    _, maps = dp
    return ServiceTable(maps)


@pytest.fixture
def three(table):
    table.put(LbService(key=A, cluster=tuple(bs(3)), frontends=(NODE_PORT,)))
    table.put(LbService.simple(B, bs(10, base=100)))
    table.put(LbService.simple(C6, bs(2, v6=True)))
    assert table.drifted([A, B, C6]) == []
    assert table.stray_entries(table.frontend_snapshot()) == []
    return table


def test_a_service_port_altered_behind_the_records_back_is_found(three, other):
    other.set_backends(B, bs(10, base=150))
    assert three.drifted([A, B, C6]) == [B]
    assert three.drifted([A, C6]) == []            # only what is asked for is read


def test_a_deleted_frontend_a_deleted_port_and_a_deleted_marker_are_found(three, other, dp):
    _, maps = dp
    maps.services.delete(NODE_PORT.key.to_c())      # one frontend of A
    other.delete(C6)                                # C6 whole (its marker with it)
    assert sorted(three.drifted([A, B, C6])) == sorted([A, C6])
    st = three.get(B)
    maps.services.delete(_marker_key(B.vip))
    assert three.drifted([B]) == [B]
    assert three.get(B) == st


def test_a_missing_maglev_chunk_or_slot_is_found(three, dp):
    import ctypes

    from kxlb.loader.layout import MaglevKey

    _, maps = dp
    st = three.get(B)
    maps.maglev.delete(MaglevKey(svc_id=st.svc_id, chunk=0, gen=st.gen, set=0))
    assert three.drifted([B]) == [B]
    st = three.get(A)
    idx = ctypes.c_uint32(st.runs[0] + 2)
    slot = maps.backends.get(idx)
    slot.tag ^= 1                      # the slot as another set's (the other generation's)
    maps.backends.put(idx, slot)
    assert three.drifted([A, C6]) == [A]


def test_entries_another_writer_added_are_strays_and_the_records_own_are_not(three, other):
    snap = three.frontend_snapshot()
    assert three.stray_entries(snap) == []
    other.put(LbService(key=ServiceKey("10.96.40.9", 80, 6), cluster=tuple(bs(1)),
                        frontends=(Frontend(ServiceKey("192.168.40.10", 30099, 6), Kind.NODE_PORT),)))
    strays = three.stray_entries(three.frontend_snapshot())
    assert sorted(strays) == sorted(["frontend 10.96.40.9:80/tcp (service id %d)" % other.get(
        ServiceKey("10.96.40.9", 80, 6)).svc_id, "frontend 192.168.40.10:30099/tcp (service id %d)" % other.get(
        ServiceKey("10.96.40.9", 80, 6)).svc_id, "marker of 10.96.40.9"])
    # Written or deleted by the record's own table after the snapshot: not a stray.
    snap = three.frontend_snapshot()
    three.delete(A)
    three.put(LbService.simple(A, bs(2)))
    assert not any("10.96.40.1" in s or "30080" in s for s in three.stray_entries(snap))


def test_a_snapshots_stray_that_went_away_meanwhile_is_not_reported(three, other):
    k = ServiceKey("10.96.40.9", 80, 6)
    other.put(LbService.simple(k, bs(1)))
    snap = three.frontend_snapshot()
    other.delete(k)
    assert three.stray_entries(snap) == []


# --- pacing (pure) ------------------------------------------------------------------------

def walk(sweep: DriftSweep, items: list, times: list[float]) -> list[list]:
    out = []
    for t in times:
        new, lo, hi = sweep.step(t)
        out.append((new, DriftSweep.part(items, lo, hi)))
    return out


def test_a_cycle_checks_every_item_once_in_shares_that_follow_the_clock():
    items = list(range(20000))
    sweep = DriftSweep(period=3600.0)
    sweep.checked_all(0.0)          # the first sync read everything
    steps = walk(sweep, items, [30.0 * i for i in range(1, 121)])   # a run every reconcile period
    assert [new for new, _ in steps] == [False] * 119 + [True]
    # The cycle that starts at 3600 s has checked nothing yet; the one before is whole.
    sweep2 = DriftSweep(period=3600.0)
    sweep2.checked_all(0.0)
    sweep2.step(3600.0)
    got = [p for _, p in walk(sweep2, items, [3600.0 + 30.0 * i for i in range(1, 121)])]
    flat = [x for p in got for x in p]
    assert flat == items                                # each item once, in order
    assert max(map(len, got)) <= 200                    # 20000 / 120 runs, +- rounding


def test_many_runs_take_small_shares_and_a_late_run_catches_up_within_the_period():
    items = list(range(1000))
    sweep = DriftSweep(period=100.0)
    sweep.checked_all(0.0)
    sweep.step(100.0)               # cycle 2 starts at 100 s
    shares = [len(p) for _, p in walk(sweep, items, [100.0 + i / 10 for i in range(1, 101)])]
    assert sum(shares) == 100 and max(shares) <= 2    # 10 s of 100 s: a tenth, in small bits
    new, lo, hi = sweep.step(250.0)  # away for 140 s: the rest of cycle 2 at once, no cycle skipped
    assert (new, lo, hi) == (False, 0.1, 1.0)
    new, lo, hi = sweep.step(250.5)  # cycle 3 began at 200 s
    assert new and lo == 0.0 and hi == pytest.approx(0.505)


def test_after_a_long_absence_the_next_cycle_starts_now():
    sweep = DriftSweep(period=10.0)
    sweep.checked_all(0.0)
    assert sweep.step(95.0)[0] is True and sweep.start == 95.0


def test_a_period_of_zero_checks_everything_every_run():
    sweep = DriftSweep(period=0.0)
    sweep.checked_all(0.0)
    assert [sweep.step(t)[1:] for t in (0.1, 0.2)] == [(0.0, 1.0), (0.0, 1.0)]
