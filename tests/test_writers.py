"""Writers of one pin directory: one at a time, and none can leave a half-written service
behind, not even when killed with SIGKILL between two of its writes (loader/lock.py,
loader/journal.py). Real processes, real pinned maps."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kxlb.loader import datapath
from kxlb.loader.layout import V4, port_to_raw
from kxlb.loader.lock import WriterLock
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable, slot_tag


def kxlb(pin_dir, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def loaded(pin_dirs):
    """A datapath prepared as `kxlb load` prepares it (registry included), attached nowhere."""
    pin = pin_dirs()
    datapath.load([], pin_dir=pin)
    yield pin
    datapath.unload(pin)


@pytest.fixture
def pin(loaded):
    yield loaded
    with Maps.open(loaded) as maps:
        for st in ServiceTable(maps).read_all().values():
            ServiceTable(maps).delete(st.key)


def map_keys(pin, name):
    with Maps.open(pin) as maps:
        return list(getattr(maps, name).keys())


def services(pin):
    with Maps.open(pin) as maps:
        return ServiceTable(maps).read_all()


def written_slots(pin) -> dict[int, tuple]:
    """The IPv4 backend array's slots that hold anything: index -> (address, port, tag)."""
    import ctypes

    with Maps.open(pin) as maps:
        m = maps.backends
        size, raw = ctypes.sizeof(m.value_t), m.values_raw(0, m.max_entries)
        zero = bytes(size)
        return {i: (lambda v: (V4.c_addr(v.addr), v.port, v.tag))(m.value_t.from_buffer_copy(raw, i * size))
                for i in range(len(raw) // size) if raw[i * size:(i + 1) * size] != zero}


def slots_in_use(pin) -> int:
    """Backend slots a fresh writer counts as taken (the runs frontends name)."""
    with Maps.open(pin) as maps:
        t = ServiceTable(maps)
        t.reload()
        return t.slots_used


def test_four_shells_adding_services_at_once_get_one_id_each(pin):
    """Four shells, 25 `service add` each, all at once: every command succeeds, 100
    service ports with 100 distinct ids, each VIP with its own backend (before the lock,
    pairs of services shared an id and one VIP sent traffic to the other's backends)."""
    def shell(n: int) -> list[int]:
        codes = []
        for i in range(25):
            r = kxlb(pin, "service", "add", f"10.97.{n}.{i + 1}:80/tcp", f"10.2.{n}.{i + 1}:8080")
            codes.append(r.returncode)
            assert r.returncode == 0, r.stderr
        return codes
    with ThreadPoolExecutor(4) as pool:
        assert all(c == 0 for codes in pool.map(shell, range(4)) for c in codes)
    got = services(pin)
    assert len(got) == 100
    assert len({st.svc_id for st in got.values()}) == 100
    for key, st in got.items():
        n, i = key.vip.split(".")[2:]
        assert [str(b) for b in st.backends] == [f"10.2.{n}.{i}:8080"]


def test_a_running_controller_makes_cli_writes_fail_at_once_naming_it(pin):
    lock = WriterLock(pin).acquire(what="the controller of node test-node")
    try:
        t0 = time.monotonic()
        r = kxlb(pin, "service", "add", "10.97.9.1:80/tcp", "10.2.9.1:80", "--wait", "30")
        assert r.returncode == 1
        assert time.monotonic() - t0 < 10  # no waiting 30 s for a holder that never lets go
        assert r.stderr.count("\n") == 1 and "the controller of node test-node" in r.stderr, r.stderr
        assert f"pid {os.getpid()}" in r.stderr
    finally:
        lock.release()
    assert kxlb(pin, "service", "add", "10.97.9.1:80/tcp", "10.2.9.1:80").returncode == 0


def test_a_short_writer_is_waited_for(pin):
    lock = WriterLock(pin).acquire()
    proc = subprocess.Popen([sys.executable, "-m", "kxlb", "--pin-dir", pin, "service", "add", "10.97.9.2:80/tcp",
                             "10.2.9.2:80", "--wait", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    assert proc.poll() is None  # waiting
    lock.release()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    r = kxlb(pin, "service", "add", "10.97.9.3:80/tcp", "10.2.9.3:80", "--wait", "0")
    assert r.returncode == 0, r.stderr


# A `kxlb service ...` command that SIGKILLs itself at an exact point of its writes: the
# N-th call of a BpfMap write method (a real kill, between two real map writes).
KILL_AT = r"""
import os, signal, sys
from kxlb.loader import maps
method, n = sys.argv[1], int(sys.argv[2])
real = getattr(maps.BpfMap, method)
calls = [0]
def patched(self, *a, **kw):
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **kw)
setattr(maps.BpfMap, method, patched)
from kxlb.cli import main
sys.exit(main(sys.argv[3:]))
"""


def killed_at(pin, method, n, *args):
    r = subprocess.run([sys.executable, "-c", KILL_AT, method, str(n), "--pin-dir", pin, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)


BIG = [f"10.3.{i // 250}.{i % 250 + 1}:80" for i in range(600)]


def test_an_add_killed_after_its_slots_leaves_nothing(pin):
    """Killed between writing 600 slots (and their Maglev table) and the frontends: the
    next writer rolls the add back. Before the journal, the chunks stayed for ever,
    counted against the map's capacity; the slots are a run no frontend names, free by
    construction (loader/slots.py), and the next writer's run starts on them."""
    killed_at(pin, "put_many_raw", 3, "service", "add", "10.97.1.1:80/tcp", *BIG)  # slots, chunks, then killed
    left = written_slots(pin)
    assert sorted(left) == list(range(1, 601))  # what the killed writer left
    r = kxlb(pin, "service", "add", "10.97.1.2:80/tcp", "10.2.1.2:80")
    assert r.returncode == 0, r.stderr
    assert "repaired" in r.stderr
    got = services(pin)
    assert [str(k) for k in got] == ["10.97.1.2:80/tcp"]
    st = got[next(iter(got))]
    assert st.runs[0] == 1 and written_slots(pin)[1] == ("10.2.1.2", port_to_raw(80), slot_tag(st.svc_id, st.gen))
    assert slots_in_use(pin) == 1
    assert len(map_keys(pin, "maglev")) == 0  # a set of one has no table
    with Maps.open(pin) as maps:  # no marker left for the cluster IP that never came to be
        assert [V4.c_addr(k.vip) for k, v in maps.services.items()] .count("10.97.1.1") == 0


@pytest.mark.parametrize("method, n, what", [
    ("put_many_raw", 2, "after the new generation's slots"),       # slots, then killed before the table
    ("put_many_raw", 3, "after the new generation's table"),       # frontends never flipped: roll back
    ("delete", 1, "after the frontends flipped"),                   # first delete of the old generation
])
def test_a_set_backends_killed_half_way_leaves_one_complete_generation(pin, method, n, what):
    assert kxlb(pin, "service", "add", "10.97.2.1:80/tcp", *BIG[:20], "--node-port", "192.0.2.1:30080").returncode == 0
    killed_at(pin, method, n, "service", "set-backends", "10.97.2.1:80/tcp", *BIG[20:50])
    r = kxlb(pin, "service", "add", "10.97.2.2:80/tcp", "10.2.2.2:80")
    assert r.returncode == 0, r.stderr
    st = next(s for k, s in services(pin).items() if str(k) == "10.97.2.1:80/tcp")
    assert len(st.backends) in (20, 30)   # the old set (rolled back) or the new one (rolled forward)
    with Maps.open(pin) as maps:
        values = [v for k, v in maps.services.items() if v.svc_id == st.svc_id]
        assert {(v.gen, v.slots, v.count) for v in values} == {(st.gen, st.runs[0], len(st.backends))}  # one generation
        assert {k.gen for k in maps.maglev.keys() if k.svc_id == st.svc_id} == {st.gen}
    slots = written_slots(pin)
    assert {slots[st.runs[0] + i][2] for i in range(len(st.backends))} == {slot_tag(st.svc_id, st.gen)}
    assert slots_in_use(pin) == len(st.backends) + 1


def test_a_delete_killed_half_way_is_finished(pin):
    assert kxlb(pin, "service", "add", "10.97.3.1:80/tcp", *BIG[:20], "--node-port", "192.0.2.1:30081").returncode == 0
    killed_at(pin, "delete", 2, "service", "del", "10.97.3.1:80/tcp")  # one frontend gone
    assert kxlb(pin, "service", "add", "10.97.3.2:80/tcp", "10.2.3.2:80").returncode == 0
    assert [str(k) for k in services(pin)] == ["10.97.3.2:80/tcp"]
    assert slots_in_use(pin) == 1 and map_keys(pin, "maglev") == []


def test_gc_removes_what_no_frontend_reaches(pin):
    """`kxlb gc`: a sweep of everything (a bulk write's repair, or orphans an older kxlb left)."""
    assert kxlb(pin, "service", "add", "10.97.4.1:80/tcp", *BIG[:20]).returncode == 0
    with Maps.open(pin) as maps:  # orphans as a killed writer could leave them: a table no frontend names
        sid = next(iter(ServiceTable(maps).read_all().values())).svc_id
        chunks = list(maps.maglev.items())
        for k, v in chunks:
            k.svc_id = sid + 1000
            maps.maglev.put(k, v)
    assert len(map_keys(pin, "maglev")) == 2 * len(chunks)
    r = kxlb(pin, "gc")
    assert r.returncode == 0, r.stderr
    assert f"{len(chunks)} orphaned Maglev chunks" in r.stdout
    assert len(map_keys(pin, "maglev")) == len(chunks)
    assert len(services(pin)) == 1 and slots_in_use(pin) == 20
