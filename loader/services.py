"""Programming services into the pinned maps, in an order that never shows a packet a
half-written service (see bpf/maps.h for the generation scheme).

Every change validates first and writes second; a write the kernel refuses is rolled
back, so a failed command leaves the maps as they were.
"""
from __future__ import annotations

import array
import ctypes
import errno
import logging
import struct
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable

from . import bpfsys, maglev
from .errors import FrontendConflict, KxlbError, MapWriteError
from .filters import AddressFilters
from .journal import Journal, range_key
from .layout import (C, DP_COUNTERS, FAMILIES, V4, Backend, Family, MaglevKey, ServiceKey,
                     SvcCounters, SvcValue, family_of, parse_net, raw_to_port)
from .maps import Maps
from .slots import SlotRuns
from .svcids import SvcIds
from .svcspec import Frontend, Kind, LbService

log = logging.getLogger("kxlb.loader")

MAX_PER_SVC = C["MAX_BACKENDS_PER_SVC"]
MAX_SVC_CIDRS = C["MAX_SVC_CIDRS"]   # per family in struct lb_config; any more: src_range_map (set_config)
SVC_CIDR_ID = C["SVC_CIDR_ID"]       # the source range maps' "service" of the service CIDRs
MARKER = C["KIND_MARKER"]
SETS = (C["SET_CLUSTER"], C["SET_LOCAL"])

# struct layouts of maps.h for bulk packing (network-order fields as raw bytes / "!H");
# tests/test_layout.py checks them against the ctypes mirrors. The per-family ones
# (svc_key, backend) are Family's.
_SVC_VALUE = struct.Struct("=IHHBBHIHHII")  # struct svc_value (both families)
_SVC_WORDS = _SVC_VALUE.size // 4


def slot_tag(svc_id: int, gen: int) -> int:
    """struct backend.tag of the slots of a set of ``svc_id`` in generation ``gen``
    (maps.h KXLB_SLOT_TAG)."""
    return (((svc_id << 1) | gen) & 0xffff) | 0x8000


@dataclass(frozen=True)
class ServiceState:
    """A service port as the maps hold it: its spec (canonical form) and where."""

    key: ServiceKey
    svc_id: int
    gen: int
    spec: LbService
    tables: tuple[int, int] = (0, 0)   # Maglev table sizes (M) of the cluster and local sets
    runs: tuple[int, int] = (0, 0)     # first backend slot of each set's run (maps.h svc_value.slots)

    @property
    def backends(self) -> tuple[Backend, ...]:
        """The cluster-wide set (all a `kxlb service add` service has)."""
        return self.spec.cluster


def validate_backends(key: ServiceKey, backends: Iterable[Backend]) -> tuple[Backend, ...]:
    return LbService.simple(key, backends).validate(MAX_PER_SVC).cluster


# maglev_map keys (struct maglev_key) are (svc_id u32, chunk u16, gen u8, set u8): the
# (chunk, gen, set) tails are packed once, and a set's keys are then one bytes.join
# (svc_id as the separator), not a pack per chunk.
# Packed as far as the largest set written so far needs (a 65,520-slot set is rare: its
# tails are not kept by every controller).
_KEY_TAILS: dict[tuple[int, int], list[bytes]] = {(g, st): [] for g in (0, 1) for st in SETS}
_PORT_BYTES: dict[int, bytes] = {}


def _keys(sid: bytes, gen: int, set_: int, n: int) -> bytes:
    if not n:
        return b""
    tails = _KEY_TAILS[(gen, set_)]
    if len(tails) < n:
        tails.extend(struct.pack("=HBB", i, gen, set_) for i in range(len(tails), max(n, 1024)))
    return sid + sid.join(tails[:n])


def _pack_slots(svc_id: int, gen: int, spec: LbService, tables: tuple[int, int],
                runs: tuple[int, int]) -> tuple[bytes, bytes, bytes, bytes, int]:
    """Both sets' backend_map slots (their runs from ``runs``) and maglev_map chunks,
    packed as maps.h lays them out: (slot keys, slot values, chunk keys, chunk values,
    chunk count)."""
    sid = struct.pack("=I", svc_id)
    fam = spec.key.family
    pton, ports = fam.pton, _PORT_BYTES
    tag = struct.pack("=H", slot_tag(svc_id, gen))
    slot_keys, slot_vals, table_keys, table_vals = [], [], [], []
    n_chunks = 0
    for set_, backends, m, base in zip(SETS, (spec.cluster, spec.local), tables, runs):
        if not backends:
            continue
        vals = b"".join([pton(b.addr) + (ports.get(b.port) or ports.setdefault(b.port, b.port.to_bytes(2, "big"))) + tag
                         for b in backends])
        slot_keys.append(array.array("I", range(base, base + len(backends))).tobytes())
        slot_vals.append(vals)
        if m:
            nc = maglev.n_chunks(m)
            table_keys.append(_keys(sid, gen, set_, nc))
            table_vals.append(maglev.packed_chunks(vals, fam.backend.size, fam.ident_len, m))
            n_chunks += nc
    return b"".join(slot_keys), b"".join(slot_vals), b"".join(table_keys), b"".join(table_vals), n_chunks


def _svc_value(spec: LbService, kind: Kind, svc_id: int, gen: int, tables: tuple[int, int],
               runs: tuple[int, int]) -> bytes:
    return _SVC_VALUE.pack(svc_id, len(spec.cluster), len(spec.local), gen, int(kind), spec.flags_for(kind),
                           spec.affinity_s, *tables, *runs)


def _svc_key(key: ServiceKey) -> bytes:
    fam = family_of(key.vip)
    return fam.svc_key.pack(fam.pton(key.vip), key.port.to_bytes(2, "big"), key.proto, 0)


def _marker_key(vip: str):
    fam = family_of(vip)
    return fam.SvcKey(vip=fam.addr_c(vip))


@dataclass
class _MapUsage:
    """Entries in one family's maps a table write can fill (their capacity is checked
    before one). The Maglev table map and the service ids are shared by the families."""
    entries: int = 0  # services: frontends and markers
    ranges: int = 0   # loadBalancerSourceRanges


def _write_error(exc: OSError, what: str, map_name: str) -> KxlbError:
    """A refused write, as the one line the user gets: a full map (E2BIG: the kernel
    counted the entries; a keyed writer counts nothing before, loader/services.py
    _check_capacity) is no reason to retry, anything else may be."""
    if exc.errno in (errno.E2BIG, errno.ENOSPC):  # hash maps say E2BIG, LPM tries ENOSPC
        return KxlbError(f"{what}: {map_name} map full (the kernel refused the write; nothing was kept)")
    return MapWriteError(f"{what}: {exc}")


def _state_of(svc_id: int, entries: list[tuple[ServiceKey, SvcValue]], slots, chunks,
              ranges: Iterable[str]) -> ServiceState:
    """A service port from its frontends' entries, ``slots(base, n, tag)`` (the backends of
    a run, None for a slot not the set's) and ``chunks(gen, set)`` (Maglev chunks present). A
    set whose table or slots are incomplete reads as empty (broken), so a reconcile
    rewrites it."""
    entries = sorted(entries, key=lambda e: (e[1].kind != Kind.CLUSTER_IP, e[0]))
    key, v = entries[0]  # _primary
    tag = slot_tag(svc_id, v.gen)

    def backends(set_: int, n: int, m: int) -> tuple[Backend, ...]:
        if not n:
            return ()
        if n > 1 and (not m or chunks(v.gen, set_) != maglev.n_chunks(m)):
            return ()
        got = slots(v.local_slots if set_ == SETS[1] else v.slots, n, tag)
        return () if None in got else tuple(got)
    ext = entries[1:]
    spec = LbService(
        key=key, cluster=backends(SETS[0], v.count, v.table_size),
        local=backends(SETS[1], v.local_count, v.local_table_size),
        frontends=tuple(Frontend(k, Kind(e.kind)) for k, e in ext),
        internal_local=bool(v.flags & C["SVC_F_LOCAL"]),
        external_local=any(e.flags & C["SVC_F_LOCAL"] for _, e in ext),
        has_endpoints=bool(v.flags & C["SVC_F_HAS_ENDPOINTS"]),
        affinity_s=v.affinity_s if v.flags & C["SVC_F_AFFINITY"] else 0,
        source_ranges=tuple(ranges),
    ).canonical()
    return ServiceState(key, svc_id, v.gen, spec, (v.table_size, v.local_table_size), (v.slots, v.local_slots))


class _RunReader:
    """The backends of runs of one family's backend array: from the array's values read
    from index 0 (``source`` bytes: a full scan), or looked up (``source`` the map).
    Called as (first slot, slots, tag): one Backend per slot, None for a slot that is not
    the set's (another tag, never written, past the array)."""

    def __init__(self, fam: Family, source):
        self.fam, self.source = fam, source

    def __call__(self, base: int, n: int, tag: int) -> list[Backend | None]:
        size = self.fam.backend.size
        if isinstance(self.source, bytes):
            raw = self.source[base * size:(base + n) * size]
        else:
            raw = self.source.values_raw(base, n) if base + n <= self.source.max_entries else b""
        if base == 0 or len(raw) != n * size:
            return [None] * n
        ntop = self.fam.ntop
        return [Backend(ntop(addr), int.from_bytes(port, "big")) if t == tag else None
                for addr, port, t in self.fam.backend.iter_unpack(raw)]


_ABSENT = object()


class _Lazy(dict):
    """A dict whose missing keys are looked up (and remembered) on first use."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, key):
        value = self._load(key)
        self[key] = _ABSENT if value is None else value
        if value is None:
            raise KeyError(key)
        return value

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def pop(self, key, default=None):
        value = super().pop(key, default)
        return default if value is _ABSENT else value


class _Frontends:
    """One family's frontend map read raw, once: the frontends of a service id and the
    service ports on a cluster IP without a ctypes object or a decoded key per entry
    (140,000 entries at 70k Services)."""

    def __init__(self, maps: Maps, fam: Family):
        self.fam = fam
        keys, vals, self.n = fam.map(maps, "services").items_raw()
        self._keys, self._vals = keys, vals
        words = array.array("I", vals)           # struct svc_value: 32-bit words
        self._words = words
        self._ids = words[0::_SVC_WORDS]
        self._kinds = [(w >> 8) & 0xff for w in words[2::_SVC_WORDS]]

    def ids(self) -> set[int]:
        return {i for i, k in zip(self._ids, self._kinds) if k != MARKER}

    def runs(self) -> set[tuple[int, int]]:
        """(first slot, slots) of every backend set a frontend names."""
        w, out = self._words, set()
        for i, kind in enumerate(self._kinds):
            if kind != MARKER:
                sizes = w[i * _SVC_WORDS + 1]
                out.add((w[i * _SVC_WORDS + 5], sizes & 0xffff))
                out.add((w[i * _SVC_WORDS + 6], sizes >> 16))
        return out

    def raw_entry(self, i: int) -> tuple[Family, bytes, int, int]:
        """Entry i as (family, packed key, kind, svc_id)."""
        ks = self.fam.svc_key.size
        return self.fam, self._keys[i * ks:(i + 1) * ks], self._kinds[i], self._ids[i]

    def entries(self, svc_id: int) -> list[tuple[ServiceKey, SvcValue]]:
        ks, vs = self.fam.svc_key.size, _SVC_VALUE.size
        return [(ServiceKey.from_c(self.fam.SvcKey.from_buffer_copy(self._keys, i * ks)),
                 SvcValue.from_buffer_copy(self._vals, i * vs))
                for i, (sid, kind) in enumerate(zip(self._ids, self._kinds)) if sid == svc_id and kind != MARKER]

    def ids_at(self, vip: str, port: int | None = None, proto: int | None = None) -> set[int]:
        """Service ids with a frontend at ``vip`` (and ``port``, ``proto``)."""
        raw, ks, al = self.fam.pton(vip), self.fam.svc_key.size, self.fam.addr_len
        tail = (port.to_bytes(2, "big") if port is not None else None, proto)
        out = set()
        for i, (sid, kind) in enumerate(zip(self._ids, self._kinds)):
            k = self._keys[i * ks:(i + 1) * ks]
            if kind == MARKER or k[:al] != raw:
                continue
            if (tail[0] is None or k[al:al + 2] == tail[0]) and (proto is None or k[al + 2] == proto):
                out.add(sid)
        return out

    def cluster_ip_users(self, vip: str) -> int:
        raw, ks, al = self.fam.pton(vip), self.fam.svc_key.size, self.fam.addr_len
        return sum(1 for i, kind in enumerate(self._kinds)
                   if kind == Kind.CLUSTER_IP and self._keys[i * ks:i * ks + al] == raw)


def runs_named(maps: Maps, fam: Family) -> set[tuple[int, int]]:
    """(first slot, slots) of every run of one family's backend array that a frontend
    names, from one read of its frontend map (slot 0 is never a run: an unset one)."""
    return {(base, n) for base, n in _Frontends(maps, fam).runs() if base and n}


def slots_named(maps: Maps, fam: Family) -> int:
    """Slots of one family's backend array that frontends name (in use)."""
    return sum(n for _, n in runs_named(maps, fam))


class FrontendSnapshot:
    """Both families' frontend maps read raw at one moment (a batch read each), for
    ServiceTable.stray_entries() to go through a part at a time: a sequence of entries
    (family, packed key, kind, svc_id), each built only when its part is asked for, so a
    snapshot kept for an hour holds the packed maps, not an object per entry."""

    def __init__(self, maps: Maps):
        self._parts = [_Frontends(maps, fam) for fam in FAMILIES]

    def __len__(self) -> int:
        return sum(p.n for p in self._parts)

    def __getitem__(self, part: slice) -> list[tuple[Family, bytes, int, int]]:
        start, stop, _ = part.indices(len(self))
        out, base = [], 0
        for p in self._parts:
            out.extend(p.raw_entry(i) for i in range(max(start - base, 0), min(stop - base, p.n)))
            base += p.n
        return out

    def __iter__(self):
        return iter(self[:])


class _KeyedIndex:
    """For a writer of a few service ports (the CLI): what it needs to know, read as it
    needs it. Direct lookups answer whether a key or frontend is taken; a free id comes
    from the service id bitmap (loader/svcids.py); only a change to an existing service
    port reads its family's frontend map (to find all its frontends), never the backend
    or Maglev maps of the node."""

    def __init__(self, table: "ServiceTable", ids: SvcIds | None):
        self.table, self.bitmap = table, ids
        self._frontends: dict[Family, _Frontends] = {}

    def frontends(self, fam: Family) -> _Frontends:
        if fam not in self._frontends:
            self._frontends[fam] = _Frontends(self.table.maps, fam)
        return self._frontends[fam]

    def forget(self) -> None:
        self._frontends.clear()

    def _entry(self, key: ServiceKey) -> SvcValue | None:
        v = key.family.map(self.table.maps, "services").get(key.to_c())
        return None if v is None or v.kind == MARKER else v

    def owner(self, key: ServiceKey) -> ServiceKey | None:
        v = self._entry(key)
        return None if v is None else _primary(self.frontends(key.family).entries(v.svc_id))[0]

    def state(self, key: ServiceKey) -> ServiceState | None:
        v = self._entry(key)
        if v is None:
            return None
        entries = self.frontends(key.family).entries(v.svc_id)
        if _primary(entries)[0] != key:
            return None  # a frontend of another service port, not a service port's key
        return self.table._read_ids(key.family, {v.svc_id: entries})[0]

    def free_ids(self, n: int) -> list[int]:
        if self.bitmap is not None and self.bitmap.trusted():
            return self.bitmap.free(n)
        used = set().union(*(self.frontends(fam).ids() for fam in FAMILIES))
        if self.bitmap is not None:
            self.bitmap.rebuild(used)
        capacity = self.table.maps.svc_stats.max_entries
        return [i for i in range(1, capacity) if i not in used][:n]


def _primary(entries: list[tuple[ServiceKey, SvcValue]]) -> tuple[ServiceKey, SvcValue]:
    """A service port's own key among its frontends: its cluster IP's entry."""
    return min(entries, key=lambda e: (e[1].kind != Kind.CLUSTER_IP, e[0]))


class ServiceTable:
    """Reads and writes service ports (LbService) in one pinned datapath.

    Keeps what the maps hold (read once, then kept up to date by its own writes), so a
    long-lived writer (the controller) never rescans the maps per change; `forget()`
    drops that record after edits behind its back."""

    def __init__(self, maps: Maps, maglev_table_size: int = maglev.DEFAULT_TABLE_SIZE,
                 journal: Journal | None = None, keyed: bool = False, ids: SvcIds | None = None):
        self.maps = maps
        # keyed: a writer of a few service ports (the CLI) reads only the frontend maps and
        # the slots of the service ports it touches (_FrontendIndex), not the whole node.
        self.keyed = keyed
        self.bitmap = ids  # the service id bitmap (loader/svcids.py): kept up to date when given
        self._keyed: _KeyedIndex | None = None
        self.journal = journal or Journal(None)  # the writer's intent record (loader/journal.py)
        self.filters = AddressFilters(maps)      # set before what they stand for is written
        self.maglev_max = maglev.check_table_size(maglev_table_size)
        self._chunks_used = 0
        self._states: dict[ServiceKey, ServiceState] | None = None
        self._owner: dict[ServiceKey, ServiceKey] = {}     # frontend -> primary key
        self._ids: set[int] = set()
        self._used = {fam: _MapUsage() for fam in FAMILIES}
        self._runs: dict[Family, SlotRuns] = {}      # each family's backend slot allocator
        self._vip_users: Counter[str] = Counter()   # cluster IP -> service ports on it (markers)

    @property
    def slots_used(self) -> int:
        """Backend slots in the maps of both families (every generation being written
        included)."""
        return sum(map(self.slots_used_by, FAMILIES))

    def slots_used_by(self, fam: Family) -> int:
        """Backend slots in use in one family's array (runs freed within their quarantine
        included)."""
        return self._runs[fam].in_use if self._states is not None and fam in self._runs else 0

    def _slot_runs(self, fam: Family) -> SlotRuns:
        """The family's slot allocator; a keyed writer builds it from the frontend map on
        first use (every run a frontend names is taken)."""
        if fam not in self._runs:
            self.states  # load the record
            if fam not in self._runs:
                assert self._keyed is not None
                self._runs[fam] = self._new_runs(fam, self._keyed.frontends(fam).runs())
        return self._runs[fam]

    def _new_runs(self, fam: Family, used: Iterable[tuple[int, int]]) -> SlotRuns:
        return SlotRuns(fam.map(self.maps, "backends").max_entries, used, what=f"backend{fam.suffix}")

    def forget(self) -> None:
        """Re-read the maps on next use."""
        self._states = None
        self._runs.clear()

    forget_counts = forget

    @property
    def states(self) -> dict[ServiceKey, ServiceState]:
        """The service ports in the maps, by key (keyed: looked up as they are asked for;
        iterating them is not possible then)."""
        if self._states is None:
            if self.keyed:
                self._index()
            else:
                self.reload()
        assert self._states is not None
        return self._states

    def _index(self) -> None:
        self._keyed = _KeyedIndex(self, self.bitmap)
        self._runs.clear()
        self._states = _Lazy(self._keyed.state)
        self._owner = _Lazy(self._keyed.owner)
        self._vip_users = Counter()

    @property
    def loaded(self) -> bool:
        """Whether the record is in memory (False: the next use reads the maps)."""
        return self._states is not None

    def reload(self) -> dict[ServiceKey, ServiceState]:
        """Read the maps and take what they hold as the record; returns what was read."""
        actual, usage, chunks, runs = self._scan()
        self._adopt(actual, usage, chunks)
        self._runs = {fam: self._new_runs(fam, runs[fam]) for fam in FAMILIES}
        if self.bitmap is not None:
            self.bitmap.rebuild(self._ids)  # the ids just read are the truth
        return actual

    def _adopt(self, actual: dict[ServiceKey, ServiceState], usage: dict[Family, _MapUsage], chunks: int) -> None:
        self._states = {}
        self._owner.clear()
        self._vip_users.clear()
        for st in actual.values():
            self._remember(st)
        self._ids = {st.svc_id for st in actual.values()}
        # Everything in the maps counts against their capacity, also entries no state
        # owns (a generation half written by a writer that died, a marker left over).
        self._used, self._chunks_used = usage, chunks

    def sync_markers(self) -> None:
        """Rewrite every cluster IP's marker entry (after edits behind our back)."""
        self.states  # load the record
        live = set(self._vip_users)
        for fam in FAMILIES:
            services = fam.map(self.maps, "services")
            for k, v in services.items():
                if v.kind == MARKER and fam.c_addr(k.vip) not in live:
                    self._used[fam].entries -= services.delete(k)
        for vip in live:
            self._sync_marker(vip)

    def _remember(self, st: ServiceState) -> None:
        assert self._states is not None
        self._states[st.key] = st
        self._vip_users[st.key.vip] += 1
        for fe in st.spec.all_frontends:
            self._owner[fe.key] = st.key

    def _forget_state(self, st: ServiceState) -> None:
        assert self._states is not None
        if self._states.pop(st.key, None) is not None:
            self._vip_users[st.key.vip] -= 1
            if not self._vip_users[st.key.vip]:
                del self._vip_users[st.key.vip]
        for fe in st.spec.all_frontends:
            if self._owner.get(fe.key) == st.key:
                del self._owner[fe.key]

    # --- reading ------------------------------------------------------------------------
    def read_all(self) -> dict[ServiceKey, ServiceState]:
        """Every service port in the maps, rebuilt from the maps alone."""
        return self._scan()[0]

    def _scan(self) -> tuple[dict[ServiceKey, ServiceState], dict[Family, _MapUsage], int,
                             dict[Family, set[tuple[int, int]]]]:
        """One pass over the maps: the service ports they hold, how full each family's
        maps are, the Maglev chunks in use, and the backend runs frontends name."""
        chunks: Counter[tuple[int, int, int]] = Counter((k.svc_id, k.gen, k.set) for k in self.maps.maglev.keys())
        usage: dict[Family, _MapUsage] = {}
        runs: dict[Family, set[tuple[int, int]]] = {}
        out: dict[ServiceKey, ServiceState] = {}
        for fam in FAMILIES:
            usage[fam], runs[fam] = self._scan_family(fam, chunks, out)
        return out, usage, sum(chunks.values()), runs

    def _scan_family(self, fam: Family, chunks: Counter[tuple[int, int, int]],
                     out: dict[ServiceKey, ServiceState]) -> tuple[_MapUsage, set[tuple[int, int]]]:
        ranges = self._ranges(fam)
        by_id, n_entries = self._frontends_by_id(fam)
        runs = {(base, n) for entries in by_id.values() for _, v in entries
                for base, n in ((v.slots, v.count), (v.local_slots, v.local_count)) if n}
        # The array read once, up to the last slot any run uses, in batches (not a lookup
        # per slot: 20k services hold ~200k slots).
        end = max((b + n for b, n in runs), default=0)
        backends = fam.map(self.maps, "backends")
        raw = backends.values_raw(0, min(end, backends.max_entries))
        reader = _RunReader(fam, raw)
        for svc_id, entries in by_id.items():
            st = _state_of(svc_id, entries, reader, lambda g, set_: chunks[(svc_id, g, set_)],
                           ranges.get(svc_id, ()))
            out[st.key] = st
        return _MapUsage(entries=n_entries, ranges=sum(map(len, ranges.values()))), runs

    def _frontends_by_id(self, fam: Family) -> tuple[dict[int, list[tuple[ServiceKey, SvcValue]]], int]:
        """One family's frontends by service id, and the entries of its map (markers too)."""
        by_id: dict[int, list[tuple[ServiceKey, SvcValue]]] = {}
        n_entries = 0
        for k, v in fam.map(self.maps, "services").items():
            n_entries += 1
            if v.kind != MARKER:
                by_id.setdefault(v.svc_id, []).append((ServiceKey.from_c(k), v))
        return by_id, n_entries

    def _ranges(self, fam: Family) -> dict[int, list[str]]:
        """One family's loadBalancerSourceRanges by service id."""
        ranges: dict[int, list[str]] = {}
        for k in fam.map(self.maps, "src_ranges").keys():
            ranges.setdefault(k.svc_id, []).append(f"{fam.c_addr(k.addr)}/{k.prefixlen - 32}")
        return ranges

    def read_matching(self, vip: str, port: int | None = None, proto: int | None = None) -> list[ServiceState]:
        """The service ports with a frontend at ``vip`` (and ``port``/``proto``), read from
        the maps with one raw pass over the frontend map and direct lookups of their
        slots: no scan of the backend and Maglev maps (`kxlb list VIP` on a node with 70k
        services)."""
        fam = family_of(vip)
        fronts = _Frontends(self.maps, fam)
        wanted = fronts.ids_at(vip, port, proto)
        return sorted(self._read_ids(fam, {i: fronts.entries(i) for i in wanted}), key=lambda st: st.key)

    def get(self, key: ServiceKey) -> ServiceState | None:
        """As this table last read or wrote it (see read_backends for a fresh look)."""
        return self.states.get(key)

    def read_backends(self, key: ServiceKey) -> tuple[Backend, ...] | None:
        """The cluster-wide set of a service port straight from the maps (for a reader
        polling another process's writes); None if there is no such service port."""
        fam = key.family
        v = fam.map(self.maps, "services").get(key.to_c())
        if v is None or v.kind != Kind.CLUSTER_IP:
            return None
        got = _RunReader(fam, fam.map(self.maps, "backends"))(v.slots, v.count, slot_tag(v.svc_id, v.gen))
        return tuple(b for b in got if b is not None)

    # --- drift checks a piece at a time (controller/sweep.py) -----------------------------
    def drifted(self, keys: Iterable[ServiceKey]) -> list[ServiceKey]:
        """Of ``keys`` (service ports of the record), those whose content in the maps is not
        what the record says: each read back with direct lookups of the frontends the record
        gives it, their slots, Maglev chunks and its cluster IP's marker. No scan: checking
        a few hundred costs milliseconds whatever the node holds, so a controller can spread
        the check of every service port over its full-sync period. Entries the record does
        not know of are stray_entries()' to find."""
        states = self.states
        by_fam: dict[Family, dict[int, list[tuple[ServiceKey, SvcValue]]]] = {}
        want: dict[tuple[Family, int], ServiceState] = {}
        out: list[ServiceKey] = []
        for key in keys:
            st = states.get(key)
            if st is None:
                continue  # deleted since the key was picked: nothing to check
            fam = key.family
            svc = fam.map(self.maps, "services")
            entries = [(fe.key, v) for fe in st.spec.all_frontends
                       if (v := svc.get(fe.key.to_c())) is not None and v.kind != MARKER and v.svc_id == st.svc_id]
            marker = svc.get(_marker_key(key.vip))
            if not entries or marker is None or marker.kind != MARKER:
                out.append(key)
                continue
            by_fam.setdefault(fam, {})[st.svc_id] = entries
            want[(fam, st.svc_id)] = st
        for fam, by_id in by_fam.items():
            for got in self._read_ids(fam, by_id):
                st = want[(fam, got.svc_id)]
                if got.key != st.key or got.spec != st.spec:
                    out.append(st.key)
        return out

    def frontend_snapshot(self) -> FrontendSnapshot:
        """Every entry of both families' frontend maps, read now, for stray_entries()."""
        return FrontendSnapshot(self.maps)

    def stray_entries(self, snapshot: Iterable[tuple[Family, bytes, int, int]]) -> list[str]:
        """Of a frontend_snapshot()'s entries, those the record does not account for and
        that are still in the map as they were: a frontend no service port of the record
        has under that id, or a marker of an address no cluster IP of the record uses
        (each described). Entries written or deleted by this table since the snapshot are
        the record's and are not reported."""
        self.states  # load the record
        out = []
        for fam, raw, kind, svc_id in snapshot:
            c_key = fam.SvcKey.from_buffer_copy(raw)
            if kind == MARKER:
                vip = fam.c_addr(c_key.vip)
                if vip not in self._vip_users:
                    now = fam.map(self.maps, "services").get(c_key)
                    if now is not None and now.kind == MARKER:
                        out.append(f"marker of {vip}")
                continue
            key = ServiceKey.from_c(c_key)
            owner = self._owner.get(key)
            owner_id = self._states[owner].svc_id if owner in self._states else None
            if owner_id == svc_id:
                continue
            now = fam.map(self.maps, "services").get(c_key)   # as it was in the snapshot?
            if now is not None and now.kind != MARKER and now.svc_id != owner_id:
                out.append(f"frontend {key} (service id {now.svc_id})")
        return out

    def _read_ids(self, fam: Family, by_id: dict[int, list[tuple[ServiceKey, SvcValue]]]) -> list[ServiceState]:
        """Service ports from their frontends' entries, their slots and tables read with
        direct lookups (no scan of the backend and Maglev maps)."""
        reader = _RunReader(fam, fam.map(self.maps, "backends"))

        def chunks(svc_id: int, g: int, set_: int) -> int:
            n = 0
            while self.maps.maglev.get(MaglevKey(svc_id=svc_id, chunk=n, gen=g, set=set_)) is not None:
                n += 1
            return n
        ranges = self._ranges(fam) if by_id else {}
        out = []
        for svc_id, entries in by_id.items():
            out.append(_state_of(svc_id, entries, reader, lambda g, set_: chunks(svc_id, g, set_),
                                 ranges.get(svc_id, ())))
        return out

    # --- writing ------------------------------------------------------------------------
    def _check_capacity(self, fam: Family, services: int, slots: int, entries: int = 0, ranges: int = 0,
                        chunks: int = 0) -> None:
        if self.keyed:
            # The big maps are not counted (that is a scan): the kernel refuses a write to a
            # full one (_write_error). Source ranges are few: counted.
            if ranges > 0:
                self._used[fam].ranges = sum(1 for _ in fam.map(self.maps, "src_ranges").keys())
                self._check_ranges(fam, ranges)
            return
        capacity = self.maps.svc_stats.max_entries
        if len(self._ids) + services > capacity - 1:  # svc_id 0 is never used
            raise KxlbError(f"service map full: {len(self._ids)} of {capacity - 1} service ports used, "
                            f"{services} more needed")
        used, v6 = self._used[fam], fam.suffix
        svcs, runs = fam.map(self.maps, "services"), self._slot_runs(fam)
        if slots > runs.free:
            raise KxlbError(f"backend{v6} map full: {runs.used} of {runs.capacity - 1} slots "
                            f"used, {slots} more needed")
        if self._chunks_used + chunks > self.maps.maglev.max_entries:
            raise KxlbError(f"Maglev table map full: {self._chunks_used} of {self.maps.maglev.max_entries} chunks "
                            f"used, {chunks} more needed (a smaller --maglev-table-size needs fewer)")
        if ranges > 0:
            self._check_ranges(fam, ranges)
        if used.entries + entries > svcs.max_entries:
            raise KxlbError(f"frontend{v6} map full: {used.entries} of {svcs.max_entries} entries "
                            f"used, {entries} more needed")

    def _free_ids(self, n: int) -> list[int]:
        """``n`` service ids no service port uses (lowest first)."""
        capacity = self.maps.svc_stats.max_entries
        if self._keyed is not None:
            free = self._keyed.free_ids(n)
        else:
            free = [i for i in range(1, capacity) if i not in self._ids][:n]
        if len(free) < n:
            raise KxlbError(f"service map full: {n} more service ports do not fit the {capacity - 1} ids")
        return free

    def _use_id(self, svc_id: int, used: bool) -> None:
        if used:
            self._ids.add(svc_id)
        else:
            self._ids.discard(svc_id)
        if self.bitmap is not None:
            self.bitmap.mark(svc_id, used)

    def _check_ranges(self, fam: Family, ranges: int) -> None:
        used, src_ranges = self._used[fam], fam.map(self.maps, "src_ranges")
        if used.ranges + ranges > src_ranges.max_entries:
            raise KxlbError(f"source range{fam.suffix} map full: {used.ranges} of {src_ranges.max_entries} "
                            f"loadBalancerSourceRanges used, {ranges} more needed")

    def _check_frontends(self, spec: LbService) -> None:
        taken = [(fe, self._owner[fe.key]) for fe in spec.all_frontends
                 if self._owner.get(fe.key) not in (None, spec.key)]
        if taken:
            raise FrontendConflict(f"service {spec.label}: " + "; ".join(
                f"frontend {fe} is already served by {owner}" for fe, owner in taken), [fe for fe, _ in taken])

    def _prepare(self, spec: LbService) -> LbService:
        spec.validate(MAX_PER_SVC)   # a set that fits it fits a Maglev table (maglev.table_size)
        self.states  # load the record
        return spec.canonical()

    def tables_for(self, spec: LbService) -> tuple[int, int]:
        """Maglev table sizes of a spec's two sets under this table's maximum."""
        return maglev.table_size(len(spec.cluster), self.maglev_max), maglev.table_size(len(spec.local), self.maglev_max)

    def _note(self, specs: Iterable[LbService], fronts: bool = True, backends: bool = True) -> None:
        """The address filters' bits of these service ports' frontends and/or backends, set
        before they are written (a packet must never find an entry without its bit)."""
        specs = list(specs)
        try:
            self.filters.add((fe.key.vip for s in specs for fe in s.all_frontends) if fronts else (),
                             ((b.addr, b.port) for s in specs for b in (*s.cluster, *s.local)) if backends else ())
        except OSError as exc:
            raise _write_error(exc, f"service {specs[0].label}: writing the address filters failed",
                               "address filter") from None

    def _alloc_runs(self, spec: LbService) -> tuple[int, int]:
        """Free runs of the backend array for both sets of ``spec`` (0 for an empty set)."""
        runs = self._slot_runs(spec.key.family)
        first = runs.alloc(len(spec.cluster)) if spec.cluster else 0
        try:
            return first, runs.alloc(len(spec.local)) if spec.local else 0
        except KxlbError:
            runs.free_run(first, len(spec.cluster))
            raise

    def _write_slots(self, spec: LbService, svc_id: int, gen: int, tables: tuple[int, int]) -> tuple[int, int]:
        """Both sets' slots, in runs allocated now, and Maglev tables under ``gen``;
        returns the runs."""
        self._note((spec,), fronts=False)
        runs = self._alloc_runs(spec)
        keys, vals, tkeys, tvals, nt = _pack_slots(svc_id, gen, spec, tables, runs)
        n = len(spec.cluster) + len(spec.local)
        fam = spec.key.family
        for name, m, k, v, count in (("backend", fam.map(self.maps, "backends"), keys, vals, n),
                                     ("Maglev table", self.maps.maglev, tkeys, tvals, nt)):
            try:
                m.put_many_raw(k, v, count)
            except OSError as exc:
                self._delete_slots(spec, svc_id, gen, tables, runs, written=False)
                raise _write_error(exc, f"service {spec.label}: writing backends failed", name) from None
        self._chunks_used += nt
        return runs

    def _delete_slots(self, spec: LbService, svc_id: int, gen: int, tables: tuple[int, int],
                      runs: tuple[int, int], written: bool = True) -> None:
        """A generation's tables go; its runs are freed (reused after their quarantine:
        loader/slots.py), their slots left as they are until then."""
        chunks_gone = 0
        slot_runs = self._slot_runs(spec.key.family)
        for set_, bs, m, base in zip(SETS, (spec.cluster, spec.local), tables, runs):
            slot_runs.free_run(base, len(bs))
            for i in range(maglev.n_chunks(m)):
                chunks_gone += self.maps.maglev.delete(MaglevKey(svc_id=svc_id, chunk=i, gen=gen, set=set_))
        if written:
            self._chunks_used -= chunks_gone

    def _write_entries(self, spec: LbService, svc_id: int, gen: int, tables: tuple[int, int],
                       runs: tuple[int, int], flags: int = bpfsys.BPF_ANY) -> None:
        self._note((spec,), backends=False)  # the slots it names were noted when written
        fes = spec.all_frontends
        spec.key.family.map(self.maps, "services").put_many_raw(b"".join(_svc_key(fe.key) for fe in fes),
                                        b"".join(_svc_value(spec, fe.kind, svc_id, gen, tables, runs) for fe in fes),
                                        len(fes), flags)

    def _put_ranges(self, fam: Family, svc_id: int, cidrs: Iterable[str]) -> None:
        ranges = fam.map(self.maps, "src_ranges")
        for c in cidrs:
            ranges.put(range_key(fam, svc_id, c), ctypes.c_uint8(1))
            self._used[fam].ranges += 1

    def _delete_ranges(self, fam: Family, svc_id: int, cidrs: Iterable[str]) -> None:
        ranges = fam.map(self.maps, "src_ranges")
        for c in cidrs:
            self._used[fam].ranges -= ranges.delete(range_key(fam, svc_id, c))

    def _sync_marker(self, vip: str, in_use: bool | None = None) -> None:
        """A marker entry exists for a cluster IP exactly while some service port uses it
        (``in_use``: known by the caller)."""
        self.states  # load the record
        fam = family_of(vip)
        services, used = fam.map(self.maps, "services"), self._used[fam]
        if in_use is None and self._keyed is not None:
            self._keyed.forget()  # counted after this writer's own writes
            in_use = self._keyed.frontends(fam).cluster_ip_users(vip) > 0
        if in_use if in_use is not None else vip in self._vip_users:
            if services.get(_marker_key(vip)) is None:
                used.entries += 1
            services.put(_marker_key(vip), SvcValue(kind=MARKER))
        elif services.delete(_marker_key(vip)):
            used.entries -= 1

    def _forget_affinity(self, fam: Family, svc_id: int, keep: tuple[set[Backend], set[Backend]] | None) -> None:
        """Drop affinity entries of a service port: all (keep None), or those whose backend
        left its set, so no client is sent to a backend the service no longer has."""
        affinity = fam.map(self.maps, "affinity")
        for k, v in affinity.items():
            if k.svc_id != svc_id:
                continue
            be = Backend(fam.c_addr(v.addr), raw_to_port(v.port))
            if keep is None or k.set >= len(keep) or be not in keep[k.set]:
                affinity.delete(k)

    def put(self, spec: LbService) -> ServiceState:
        """Make the maps serve ``spec``: add it, or change the service port of its key in
        an order no packet can see half done (maps.h)."""
        spec = self._prepare(spec)
        cur = self.states.get(spec.key)
        self._check_frontends(spec)
        fam = spec.key.family
        if cur is None:
            return self._add(spec)
        if cur.spec == spec:
            return cur
        old = cur.spec
        sets_changed = (old.cluster, old.local) != (spec.cluster, spec.local)
        # Unchanged sets keep their tables (and sizes): a new --maglev-table-size applies
        # to a set when it next changes.
        tables = self.tables_for(spec) if sets_changed else cur.tables
        added_entries = len(spec.frontends) - len(old.frontends)
        new_ranges = set(spec.source_ranges) - set(old.source_ranges)
        self._check_capacity(fam, 0, len(spec.cluster) + len(spec.local) if sets_changed else 0, added_entries,
                             len(new_ranges), sum(map(maglev.n_chunks, tables)) if sets_changed else 0)
        new_gen = 1 - cur.gen if sets_changed else cur.gen
        with self.journal.intent("update", [cur.svc_id], [spec.key.vip], gen=new_gen,
                                 ranges_gone=set(old.source_ranges) - set(spec.source_ranges)):
            return self._update(cur, spec, tables, sets_changed, new_ranges, added_entries)

    def _update(self, cur: ServiceState, spec: LbService, tables: tuple[int, int], sets_changed: bool,
                new_ranges: set[str], added_entries: int) -> ServiceState:
        old, fam = cur.spec, spec.key.family
        svc_id, gen, runs = cur.svc_id, cur.gen, cur.runs
        if sets_changed:
            gen = 1 - cur.gen
            runs = self._write_slots(spec, svc_id, gen, tables)  # 1. invisible new generation
        try:
            self._put_ranges(fam, svc_id, new_ranges)
        except OSError as exc:
            self._delete_ranges(fam, svc_id, new_ranges)
            if sets_changed:
                self._delete_slots(spec, svc_id, gen, tables, runs)
            raise _write_error(exc, f"service {spec.label}: writing source ranges failed", "source range") from None
        gone = {fe.key for fe in old.frontends} - {fe.key for fe in spec.frontends}
        for k in gone:                                         # 2a. frontends that went
            fam.map(self.maps, "services").delete(k.to_c())
        try:
            self._write_entries(spec, svc_id, gen, tables, runs)  # 2b. every frontend flips at once
        except OSError as exc:
            try:
                self._write_entries(old, svc_id, cur.gen, cur.tables, cur.runs)
            except OSError:
                pass
            if sets_changed:
                self._delete_slots(spec, svc_id, gen, tables, runs)
            self._forget_state(cur)
            self._states = None                                # unknown now: re-read next time
            raise _write_error(exc, f"service {spec.label}: switching to the new frontends/backends failed",
                               "frontend") from None
        self._used[fam].entries += added_entries
        if sets_changed:
            self._delete_slots(old, svc_id, cur.gen, cur.tables, cur.runs)  # 3. the old generation goes
        self._delete_ranges(fam, svc_id, set(old.source_ranges) - set(spec.source_ranges))
        if old.affinity_s and (not spec.affinity_s or sets_changed):
            self._forget_affinity(fam, svc_id, (set(spec.cluster), set(spec.local)) if spec.affinity_s else None)
        self._forget_state(cur)
        st = ServiceState(spec.key, svc_id, gen, spec, tables, runs)
        self._remember(st)
        return st

    def _add(self, spec: LbService) -> ServiceState:
        tables = self.tables_for(spec)
        fam = spec.key.family
        self._check_capacity(fam, 1, len(spec.cluster) + len(spec.local), len(spec.all_frontends) + 1,
                             len(spec.source_ranges), sum(map(maglev.n_chunks, tables)))
        svc_id = self._free_ids(1)[0]
        with self.journal.intent("add", [svc_id], [spec.key.vip]):
            return self._add_as(spec, svc_id, tables)

    def _add_as(self, spec: LbService, svc_id: int, tables: tuple[int, int]) -> ServiceState:
        fam = spec.key.family
        # 1. fresh counters, 2. slots and ranges, 3. the entries that make them reachable.
        self.maps.svc_stats.put(ctypes.c_uint32(svc_id), SvcCounters())
        runs = self._write_slots(spec, svc_id, 0, tables)
        try:
            self._put_ranges(fam, svc_id, spec.source_ranges)
            self._write_entries(spec, svc_id, 0, tables, runs, bpfsys.BPF_NOEXIST)
        except OSError as exc:
            for fe in spec.all_frontends:
                fam.map(self.maps, "services").delete(fe.key.to_c())
            self._delete_slots(spec, svc_id, 0, tables, runs)
            self._delete_ranges(fam, svc_id, spec.source_ranges)
            raise _write_error(exc, f"service {spec.label}: writing the service entries failed", "frontend") from None
        st = ServiceState(spec.key, svc_id, 0, spec, tables, runs)
        self._use_id(svc_id, True)
        self._used[fam].entries += len(spec.all_frontends)
        self._remember(st)
        self._sync_marker(spec.key.vip, in_use=True)
        return st

    def add(self, key: ServiceKey, backends: Iterable[Backend]) -> ServiceState:
        if key in self.states:
            raise KxlbError(f"service {key} already exists (use `service set-backends`)")
        return self.put(LbService.simple(key, backends))

    def set_backends(self, key: ServiceKey, backends: Iterable[Backend]) -> ServiceState:
        """Replace the cluster-wide set of an existing service port, options kept."""
        cur = self.states.get(key)
        if cur is None:
            raise KxlbError(f"service {key} does not exist (use `service add`)")
        backends = tuple(backends)
        return self.put(replace(cur.spec, cluster=backends, has_endpoints=bool(backends or cur.spec.local)))

    def add_many(self, specs: Iterable[LbService]) -> list[ServiceState]:
        """Add many new service ports with batch writes (all slots, then all entries): a
        full sync's path. Validates everything, and checks every family's capacity,
        before writing anything; then writes one family's batch after the other."""
        checked = [self._prepare(s) for s in specs]
        seen: set[ServiceKey] = set()
        for s in checked:
            if s.key in self.states:
                raise KxlbError(f"service {s.key} already exists")
            self._check_frontends(s)
            for fe in s.all_frontends:
                if fe.key in seen:
                    raise KxlbError(f"service {s.label}: frontend {fe} is listed by another service too")
                seen.add(fe.key)
        batches = [(fam, part, [self.tables_for(s) for s in part])
                   for fam in FAMILIES if (part := [s for s in checked if s.key.family is fam])]
        for fam, part, tables in batches:
            self._check_capacity(fam, len(checked), sum(len(s.cluster) + len(s.local) for s in part),
                                 sum(len(s.all_frontends) for s in part) + len({s.key.vip for s in part}),
                                 sum(len(s.source_ranges) for s in part),
                                 sum(maglev.n_chunks(m) for t in tables for m in t))
        with self.journal.intent("bulk", ()):
            return [st for fam, part, tables in batches for st in self._add_batch(fam, part, tables)]

    def _add_batch(self, fam: Family, checked: list[LbService], tables: list[tuple[int, int]]) -> list[ServiceState]:
        """add_many's writes for the (checked) service ports of one family."""
        services = fam.map(self.maps, "services")
        free = iter(self._free_ids(len(checked)))
        states = []
        try:
            for s, t in zip(checked, tables):
                states.append(ServiceState(s.key, next(free), 0, s, t, self._alloc_runs(s)))
        except KxlbError:
            for st in states:
                self._delete_slots(st.spec, st.svc_id, 0, (0, 0), st.runs, written=False)
            raise
        # Packed with struct, not one ctypes object per entry: a full sync writes ~100k.
        svc_keys, svc_vals = [], []
        for st in states:
            for fe in st.spec.all_frontends:
                svc_keys.append(_svc_key(fe.key))
                svc_vals.append(_svc_value(st.spec, fe.kind, st.svc_id, 0, st.tables, st.runs))
        n_chunks = 0
        self._note(checked)
        try:
            # Fresh counters for ids a deleted service may have used, then slots, ranges, entries.
            self.maps.svc_stats.reset_many(st.svc_id for st in states)
            # Slots and tables in batches of about 4 MB of tables: 10k services' chunks in
            # one buffer (packed, joined, copied to ctypes) would add tens of MB to the
            # controller's peak RSS. Nothing reaches them before the entries below.
            batch: list[tuple[bytes, bytes, bytes, bytes, int]] = []
            pending_slots = pending_chunks = 0
            for i, st in enumerate(states):
                batch.append(_pack_slots(st.svc_id, 0, st.spec, st.tables, st.runs))
                pending_slots += len(st.spec.cluster) + len(st.spec.local)
                pending_chunks += batch[-1][4]
                if pending_chunks >= 4096 or i == len(states) - 1:
                    sk, sv, tk, tv, _ = zip(*batch)
                    fam.map(self.maps, "backends").put_many_raw(b"".join(sk), b"".join(sv), pending_slots)
                    self.maps.maglev.put_many_raw(b"".join(tk), b"".join(tv), pending_chunks)
                    n_chunks += pending_chunks
                    batch, pending_slots, pending_chunks = [], 0, 0
            for st in states:
                self._put_ranges(fam, st.svc_id, st.spec.source_ranges)
            services.put_many_raw(b"".join(svc_keys), b"".join(svc_vals), len(svc_keys))
        except OSError as exc:
            for st in states:
                for fe in st.spec.all_frontends:
                    services.delete(fe.key.to_c())
                self._delete_slots(st.spec, st.svc_id, 0, st.tables, st.runs, written=False)
                self._delete_ranges(fam, st.svc_id, st.spec.source_ranges)
            raise MapWriteError(f"adding {len(states)} {fam.name} services failed: {exc}") from None
        used = self._used[fam]
        self._chunks_used += n_chunks
        used.entries += len(svc_keys)
        new_vips = {st.key.vip for st in states} - set(self._vip_users)
        for st in states:
            self._use_id(st.svc_id, True)
            self._remember(st)
        # Markers of cluster IPs that had none, in one batch (a full sync adds thousands).
        marker = bytes(SvcValue(kind=MARKER))
        try:
            services.put_many_raw(b"".join(_svc_key(ServiceKey(v, 0, 0)) for v in new_vips),
                                  marker * len(new_vips), len(new_vips))
        except OSError as exc:
            # The service ports are in and serve; only undefined ports of these cluster IPs
            # are not rejected until sync_markers() (the controller's reconcile) rewrites them.
            log.warning("writing %d cluster IP markers failed: %s", len(new_vips), exc)
        else:
            used.entries += len(new_vips)
        return states

    def delete(self, key: ServiceKey) -> None:
        cur = self.states.get(key)
        if cur is None:
            raise KxlbError(f"service {key} does not exist")
        with self.journal.intent("delete", [cur.svc_id], [key.vip]):
            self._delete(cur)

    def _delete(self, cur: ServiceState) -> None:
        # The entries first: from here no new flow can reach the slots.
        key, fam = cur.key, cur.key.family
        for fe in cur.spec.all_frontends:
            self._used[fam].entries -= fam.map(self.maps, "services").delete(fe.key.to_c())
        self._forget_state(cur)
        self._use_id(cur.svc_id, False)
        self.maps.svc_stats.delete(ctypes.c_uint32(cur.svc_id))  # its memory (maps.h svc_stats)
        self._sync_marker(key.vip)
        self._delete_slots(cur.spec, cur.svc_id, cur.gen, cur.tables, cur.runs)
        self._delete_ranges(fam, cur.svc_id, cur.spec.source_ranges)
        if cur.spec.affinity_s:
            self._forget_affinity(fam, cur.svc_id, None)

    # --- node configuration -------------------------------------------------------------
    def set_config(self, cfg: "DatapathConfig") -> None:
        """Write both families' struct lb_config: when to masquerade, and the service CIDRs.

        A family with more service CIDRs than the config holds has them all in its source
        range map too, under SVC_CIDR_ID (maps.h): written before the config that sends
        the datapath there, and taken away after the config that no longer does, so a
        packet never finds the flag without the entries. If that map has no room, the
        config keeps its first CIDRs without the flag (a KxlbError says which were left
        out, after the rest was written)."""
        failed = []
        for fam in FAMILIES:
            config = fam.map(self.maps, "config")
            have = self._svc_cidr_entries(fam)
            mine = cfg.cidrs_of(fam)
            want = mine if len(mine) > MAX_SVC_CIDRS else ()
            try:
                self._check_ranges(fam, len(set(want) - set(have)))
                self._put_ranges(fam, SVC_CIDR_ID, [c for c in want if c not in have])
            except (KxlbError, OSError) as exc:
                failed.append(f"{', '.join(want[MAX_SVC_CIDRS:])}: {exc}")
                config.put(ctypes.c_uint32(0), cfg.to_c(fam, all_cidrs=False))
                continue
            config.put(ctypes.c_uint32(0), cfg.to_c(fam))
            self._delete_ranges(fam, SVC_CIDR_ID, [c for c in have if c not in want])
        if failed:
            raise KxlbError(f"service CIDRs beyond the first {MAX_SVC_CIDRS} per family not written "
                            f"(the rest of the config was): {'; '.join(failed)}")

    def _svc_cidr_entries(self, fam: Family) -> tuple[str, ...]:
        """The service CIDRs a family's source range map holds (SVC_CIDR_ID's entries)."""
        return tuple(self._ranges(fam).get(SVC_CIDR_ID, ()))

    def read_config(self) -> "DatapathConfig":
        got = [DatapathConfig.from_c(fam, fam.map(self.maps, "config").get(ctypes.c_uint32(0)) or fam.LbConfig(),
                                     self._svc_cidr_entries(fam))
               for fam in FAMILIES]
        return DatapathConfig.merge(*got)

    # --- counters -----------------------------------------------------------------------
    def datapath_counters(self) -> dict[str, int]:
        """dp_stats summed over CPUs, by name (consts.h KXLB_ST_*)."""
        out = {}
        for idx, name in sorted(DP_COUNTERS.items()):
            out[name] = sum(v.value for v in self.maps.dp_stats.get(ctypes.c_uint32(idx)) or [])
        return out

    def counters(self, svc_id: int) -> SvcCounters:
        total = SvcCounters()
        for c in self.maps.svc_stats.get(ctypes.c_uint32(svc_id)) or []:
            for name, _ in SvcCounters._fields_:
                setattr(total, name, getattr(total, name) + getattr(c, name))
        return total


@dataclass(frozen=True)
class DatapathConfig:
    """The node-wide settings of the datapath (bpf/maps.h struct lb_config and
    lb_config6). Addresses and CIDRs of both families in one value, as kube-proxy's
    flags take them (--cluster-cidr 10.0.0.0/16,fd00::/48); each family's entry gets its
    own. The family-free settings are written the same into both entries."""

    snat_addrs: tuple[str, ...] = ()      # masquerade addresses (the node's), one per family; none: never
    cluster_cidrs: tuple[str, ...] = ()   # kube-proxy's detect-local, one per family; none: all clients external
    service_cidrs: tuple[str, ...] = ()   # ServiceCIDRs: bad ports rejected, the rest dropped
    masquerade_all: bool = False          # --masquerade-all
    # Source ports for masqueraded (and collision-remapped) flows: a range the node's own
    # sockets never use (controller: above ip_local_port_range). None: consts.h defaults.
    src_ports: tuple[int, int] | None = None
    # The node's own addresses (one per family): what loadBalancerSourceRanges see as the
    # source of the node's processes (socket hooks). None for a family: its snat address
    # (the same unless --masquerade-address differs from the node's IP).
    node_addrs: tuple[str, ...] = ()

    def _one(self, fam: Family, values: tuple[str, ...], what: str) -> str | None:
        """The one value of ``fam`` among ``values`` (addresses or CIDRs)."""
        mine = [v for v in values if family_of(v) is fam]
        if len(mine) > 1:
            raise KxlbError(f"{what}: {', '.join(mine)}: at most one {fam.name} value")
        return mine[0] if mine else None

    def to_c(self, fam: Family = V4, all_cidrs: bool = True):
        """This family's struct lb_config(6). ``all_cidrs``: a family with more service
        CIDRs than it holds has the rest in the source range map (the flag set)."""
        cfg = fam.LbConfig()
        if self.src_ports is not None:
            lo, hi = self.src_ports
            if not 1024 <= lo <= hi <= 65535:
                raise KxlbError(f"masquerade source ports {lo}-{hi}: expected a range within 1024-65535")
            cfg.src_port_min, cfg.src_port_max = lo, hi
        for field, what in (("snat_addr", "masquerade address"), ("node_addr", "node address")):
            addr = self._one(fam, getattr(self, field + "s"), what)
            if addr:
                setattr(cfg, field, fam.addr_c(fam.parse(addr, what)))
        cidr = self._one(fam, self.cluster_cidrs, "cluster CIDR")
        if cidr:
            net = fam.parse_net(cidr, "cluster CIDR")
            cfg.cluster_cidr = fam.addr_c(str(net.network_address))
            cfg.cluster_mask = fam.addr_c(str(net.netmask))
        mine = [parse_net(text, "service CIDR") for text in self.cidrs_of(fam)]
        for i, net in enumerate(mine[:MAX_SVC_CIDRS]):
            cfg.svc_cidr[i] = fam.addr_c(str(net.network_address))
            cfg.svc_mask[i] = fam.addr_c(str(net.netmask))
        cfg.flags = C["CFG_F_MASQUERADE_ALL"] if self.masquerade_all else 0
        if len(mine) > MAX_SVC_CIDRS and all_cidrs:
            cfg.flags |= C["CFG_F_SVC_CIDR_MAP"]   # the rest: ServiceTable.set_config
        return cfg

    def cidrs_of(self, fam: Family) -> tuple[str, ...]:
        """This family's service CIDRs, normalised (10.96.0.1/16 is 10.96.0.0/16), each once,
        in order: the config holds the first MAX_SVC_CIDRS."""
        nets = (parse_net(text, "service CIDR") for text in self.service_cidrs)
        return tuple(dict.fromkeys(str(n) for n in nets if n.version == fam.version))

    @classmethod
    def from_c(cls, fam: Family, c, more_cidrs: tuple[str, ...] = ()) -> "DatapathConfig":
        """The settings one family's entry holds; ``more_cidrs``: its service CIDRs in the
        source range map (all of them, when the entry's flag says they are there)."""
        def addr(field) -> tuple[str, ...]:
            text = fam.c_addr(field)
            return (text,) if fam.address(text) != fam.address(0) else ()

        def net(addr, mask) -> str:
            # the prefix length from the mask's bits (IPv6Network takes no netmask text)
            plen = bin(int.from_bytes(fam.pton(fam.c_addr(mask)), "big")).count("1")
            return str(fam.network(f"{fam.c_addr(addr)}/{plen}"))
        return cls(
            snat_addrs=addr(c.snat_addr),
            cluster_cidrs=(net(c.cluster_cidr, c.cluster_mask),) if addr(c.cluster_mask) else (),
            service_cidrs=tuple(dict.fromkeys(
                tuple(net(c.svc_cidr[i], c.svc_mask[i]) for i in range(MAX_SVC_CIDRS) if addr(c.svc_mask[i])) +
                (tuple(more_cidrs) if c.flags & C["CFG_F_SVC_CIDR_MAP"] else ()))),
            masquerade_all=bool(c.flags & C["CFG_F_MASQUERADE_ALL"]),
            src_ports=(c.src_port_min, c.src_port_max) if c.src_port_min else None,
            node_addrs=addr(c.node_addr),
        )

    @classmethod
    def merge(cls, v4: "DatapathConfig", v6: "DatapathConfig") -> "DatapathConfig":
        """One value from the two families' entries (the family-free settings from IPv4's)."""
        return replace(v4, snat_addrs=v4.snat_addrs + v6.snat_addrs, cluster_cidrs=v4.cluster_cidrs + v6.cluster_cidrs,
                       service_cidrs=v4.service_cidrs + v6.service_cidrs, node_addrs=v4.node_addrs + v6.node_addrs)
