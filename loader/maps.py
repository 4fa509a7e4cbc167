"""Typed access to the pinned maps: ctypes keys and values in, ctypes out.

Each map is opened from its bpffs pin and its key/value sizes are checked against the
Python mirror before any access, so a datapath of another layout is refused with a
clear message instead of being misread.
"""
from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import Generic, Iterable, Iterator, TypeVar

from . import bpfsys
from .errors import KxlbError
from .layout import (C, AffinityKey, AffinityKey6, AffinityValue, AffinityValue6, BackendValue,
                     BackendValue6, CtEntry, CtEntry6, CtKey, CtKey6, FragKey, FragKey6, FragValue, FragValue6,
                     LbConfig, LbConfig6, MaglevChunk, MaglevKey, MasqEntry, MasqEntry6, SrcRangeKey, SrcRangeKey6,
                     SvcCounters, SvcKey, SvcKey6, SvcValue)

K = TypeVar("K", bound=ctypes.Structure)
V = TypeVar("V", bound=ctypes.Structure)

DEFAULT_PIN_DIR = "/sys/fs/bpf/kxlb"


class BpfMap(Generic[K, V]):
    """A pinned BPF map with ctypes key and value types."""

    def __init__(self, path: str, key_t: type[K], value_t: type[V], percpu: bool = False):
        self.path, self.key_t, self.value_t, self.percpu = path, key_t, value_t, percpu
        try:
            self.fd = bpfsys.obj_get(path)
        except OSError as exc:
            raise KxlbError(f"cannot open map {path}: {exc.strerror} (is the datapath loaded? `kxlb load`)") from None
        info = bpfsys.map_info(self.fd)
        if info.key_size != ctypes.sizeof(key_t) or info.value_size != ctypes.sizeof(value_t):
            os.close(self.fd)
            raise KxlbError(
                f"map {path} has key/value sizes {info.key_size}/{info.value_size}, this kxlb expects "
                f"{ctypes.sizeof(key_t)}/{ctypes.sizeof(value_t)}: another build of kxlb, or another tool, made "
                f"it (`kxlb load` migrates the layouts of kxlb's releases: docs/operations.md)")
        self.max_entries = info.max_entries
        self.ncpu = bpfsys.possible_cpus() if percpu else 1
        self._stride = (ctypes.sizeof(value_t) + 7) & ~7

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _value_buf(self):
        return (ctypes.c_uint8 * (self._stride * self.ncpu))() if self.percpu else self.value_t()

    def get(self, key: K) -> V | list[V] | None:
        """The value, or (per-CPU map) the list of per-CPU values; None if absent."""
        buf = self._value_buf()
        ret = bpfsys.lib().bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(buf))
        if ret < 0:
            if -ret == errno.ENOENT or ctypes.get_errno() == errno.ENOENT:
                return None
            bpfsys.check(ret, f"lookup in {self.path}")
        return self._unpack(buf) if self.percpu else buf

    def _unpack(self, buf) -> list[V]:
        raw = bytes(buf)
        return [self.value_t.from_buffer_copy(raw, i * self._stride) for i in range(self.ncpu)]

    def put(self, key: K, value: V, flags: int = bpfsys.BPF_ANY) -> None:
        if self.percpu:
            buf = (ctypes.c_uint8 * (self._stride * self.ncpu))()
            for i in range(self.ncpu):
                ctypes.memmove(ctypes.addressof(buf) + i * self._stride, ctypes.addressof(value), ctypes.sizeof(value))
            value = buf
        bpfsys.check(bpfsys.lib().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(value), flags),
                     f"update in {self.path}")

    def delete(self, key: K) -> bool:
        ret = bpfsys.lib().bpf_map_delete_elem(self.fd, ctypes.byref(key))
        if ret < 0:
            if -ret == errno.ENOENT or ctypes.get_errno() == errno.ENOENT:
                return False
            bpfsys.check(ret, f"delete in {self.path}")
        return True

    def keys(self) -> Iterator[K]:
        prev, nxt = None, self.key_t()
        while True:
            ret = bpfsys.lib().bpf_map_get_next_key(self.fd, ctypes.byref(prev) if prev is not None else None,
                                                    ctypes.byref(nxt))
            if ret < 0:
                return
            yield self.key_t.from_buffer_copy(nxt)
            prev = self.key_t.from_buffer_copy(nxt)

    def items(self) -> list[tuple[K, V]]:
        """All entries, by batch lookup where the kernel has it (one syscall per 4096)."""
        parts = self._batched()
        if parts is None:
            return self._items_one_by_one()
        ksize, vsize = ctypes.sizeof(self.key_t), ctypes.sizeof(self.value_t)
        return [(self.key_t.from_buffer_copy(kb, i * ksize), self.value_t.from_buffer_copy(vb, i * vsize))
                for kb, vb, n in parts for i in range(n)]

    def items_raw(self) -> tuple[bytes, bytes, int]:
        """All entries as packed keys and values (n of each, in the map's layouts): the
        fast path for bulk reads, with no ctypes object per entry."""
        parts = self._batched()
        if parts is None:
            items = self._items_one_by_one()
            return b"".join(bytes(k) for k, _ in items), b"".join(bytes(v) for _, v in items), len(items)
        return b"".join(k for k, _, _ in parts), b"".join(v for _, v, _ in parts), sum(n for *_, n in parts)

    def _items_one_by_one(self) -> list[tuple[K, V]]:
        out = []
        for k in self.keys():
            v = self.get(k)
            if v is not None:
                out.append((k, v))
        return out

    def _batched(self) -> list[tuple[bytes, bytes, int]] | None:
        """Every batch of a full batch lookup, or None where the kernel has none for this
        map (per-CPU maps are read entry by entry too)."""
        if self.percpu:
            return None
        try:
            return list(self._batches())
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, bpfsys.ENOTSUPP):
                raise
            return None

    def _batches(self) -> Iterator[tuple[bytes, bytes, int]]:
        return bpfsys.lookup_batches(self.fd, ctypes.sizeof(self.key_t), ctypes.sizeof(self.value_t), what=self.path)

    def values_raw(self, start: int, n: int) -> bytes:
        """An array's values at indexes [start, start + n), packed (fewer when the array
        ends first), read with batch lookups."""
        vsize, out = ctypes.sizeof(self.value_t), []
        if n > 0 and start == 0:  # the batch token names the index before the first one read
            v = self.get(self.key_t(0))
            out.append(bytes(v) if v is not None else b"")
            start, n = 1, n - 1
        if n > 0:
            for _, vals, count in bpfsys.lookup_batches(self.fd, ctypes.sizeof(self.key_t), vsize, min(n, 4096),
                                                        self.path, after=start - 1):
                take = min(count, n)
                out.append(vals[:take * vsize])
                n -= take
                if n == 0:
                    break
        return b"".join(out)

    def put_many(self, items: list[tuple[K, V]], flags: int = bpfsys.BPF_ANY) -> None:
        """Write entries with one batch syscall; all-or-error (the caller rolls back)."""
        if not items:
            return
        self.put_many_raw(b"".join(bytes(k) for k, _ in items), b"".join(bytes(v) for _, v in items),
                          len(items), flags)

    def put_many_raw(self, key_bytes: bytes, value_bytes: bytes, n: int, flags: int = bpfsys.BPF_ANY) -> None:
        """put_many from packed keys and values (n of each, in the map's layouts): the
        fast path for bulk writes, with no ctypes object per entry."""
        if n == 0:
            return
        assert len(key_bytes) == n * ctypes.sizeof(self.key_t) and len(value_bytes) == n * ctypes.sizeof(self.value_t)
        keys = (self.key_t * n).from_buffer_copy(key_bytes)
        vals = (self.value_t * n).from_buffer_copy(value_bytes)
        count = ctypes.c_uint32(n)
        opts = bpfsys.batch_opts(flags)
        ret = bpfsys.lib().bpf_map_update_batch(self.fd, keys, vals, ctypes.byref(count), ctypes.byref(opts))
        if ret < 0:
            err = -ret
            if err in (errno.EINVAL, bpfsys.ENOTSUPP):  # no batch support for this map type
                for i in range(n):
                    self.put(keys[i], vals[i], flags)
                return
            bpfsys.check(ret, f"batch update in {self.path} ({count.value} of {n} written)")



class SvcStats:
    """Per-service counters (bpf/maps.h svc_stats): an array of maps from svc_id to the
    per-CPU counter array of its chunk of KXLB_STATS_CHUNK ids. ``put`` makes the chunk
    when its first id is used (pointing all its ids at it) and resets an id's counters;
    chunks are never unpointed, so memory follows the highest service count seen.
    Keys and values as a per-CPU map of c_uint32 -> SvcCounters."""

    CHUNK = C["STATS_CHUNK"]

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = bpfsys.obj_get(path)
        except OSError as exc:
            raise KxlbError(f"cannot open map {path}: {exc.strerror} (is the datapath loaded? `kxlb load`)") from None
        self.max_entries = bpfsys.map_info(self.fd).max_entries  # the svc_id range
        self.ncpu = bpfsys.possible_cpus()
        self._stride = (ctypes.sizeof(SvcCounters) + 7) & ~7
        self._chunks: dict[int, int] = {}     # chunk number -> the array we write new ids into
        self._by_map_id: dict[int, int] = {}  # map id -> our fd of it (kept open: keeps it alive)

    def close(self) -> None:
        for fd in self._by_map_id.values():
            os.close(fd)
        self._by_map_id.clear()
        self._chunks.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _array_of(self, svc_id: int) -> int | None:
        """An fd of the counter array svc_id's entry points to, or None. Resolved per
        id: another process may have made a different array for the same chunk."""
        map_id = ctypes.c_uint32()
        if bpfsys.lib().bpf_map_lookup_elem(self.fd, ctypes.byref(ctypes.c_uint32(svc_id)), ctypes.byref(map_id)) < 0:
            return None
        if map_id.value not in self._by_map_id:
            self._by_map_id[map_id.value] = bpfsys.map_fd_by_id(map_id.value)
        return self._by_map_id[map_id.value]

    def _chunk_array(self, chunk: int) -> int:
        """The counter array for a chunk: ours, or the one its ids point to (after a
        restart), or a new one. A chunk's ids are pointed at their array all at once,
        in one batch, and stay so: the kernel waits for an RCU grace period after every
        update of a map-in-map from user space (milliseconds), once per batch."""
        if chunk not in self._chunks:
            lo, hi = chunk * self.CHUNK, min((chunk + 1) * self.CHUNK, self.max_entries)
            fd = self._array_of(lo)
            if fd is None:
                fd = next((f for f in map(self._array_of, range(lo + 1, hi)) if f is not None), None)
                if fd is None:
                    fd = bpfsys.map_create(bpfsys.BPF_MAP_TYPE_PERCPU_ARRAY, f"kxlb_stats{chunk}", 4,
                                           ctypes.sizeof(SvcCounters), self.CHUNK)
                    self._by_map_id[bpfsys.map_info(fd).id] = fd
                self._point(range(lo, hi), fd)
            self._chunks[chunk] = fd
        return self._chunks[chunk]

    def _point(self, ids: range, fd: int) -> None:
        n = len(ids)
        keys = (ctypes.c_uint32 * n)(*ids)
        vals = (ctypes.c_uint32 * n)(*([fd] * n))
        count = ctypes.c_uint32(n)
        opts = bpfsys.batch_opts()
        if bpfsys.lib().bpf_map_update_batch(self.fd, keys, vals, ctypes.byref(count), ctypes.byref(opts)) >= 0:
            return
        for i in ids:  # a kernel without batch updates of map-in-maps: one by one
            bpfsys.check(bpfsys.lib().bpf_map_update_elem(self.fd, ctypes.byref(ctypes.c_uint32(i)),
                                                          ctypes.byref(ctypes.c_uint32(fd)), bpfsys.BPF_ANY),
                         f"update in {self.path}")

    def put(self, key: ctypes.c_uint32, value: SvcCounters) -> None:
        svc_id = key.value
        fd = self._chunk_array(svc_id // self.CHUNK)
        buf = (ctypes.c_uint8 * (self._stride * self.ncpu))()
        for i in range(self.ncpu):
            ctypes.memmove(ctypes.addressof(buf) + i * self._stride, ctypes.addressof(value), ctypes.sizeof(value))
        idx = ctypes.c_uint32(svc_id % self.CHUNK)
        bpfsys.check(bpfsys.lib().bpf_map_update_elem(fd, ctypes.byref(idx), ctypes.byref(buf), bpfsys.BPF_ANY),
                     f"reset counters of service id {svc_id}")

    def reset_many(self, ids: Iterable[int]) -> None:
        """Zero the counters of many ids (new services: an id a deleted service used keeps
        its counts until reused), one batch write per chunk (a full sync adds thousands)."""
        by_chunk: dict[int, list[int]] = {}
        for i in ids:
            by_chunk.setdefault(i // self.CHUNK, []).append(i % self.CHUNK)
        for chunk, idx in by_chunk.items():
            fd, n = self._chunk_array(chunk), len(idx)
            keys = (ctypes.c_uint32 * n)(*idx)
            vals = (ctypes.c_uint8 * (self._stride * self.ncpu * n))()
            count, opts = ctypes.c_uint32(n), bpfsys.batch_opts()
            if bpfsys.lib().bpf_map_update_batch(fd, keys, vals, ctypes.byref(count), ctypes.byref(opts)) < 0:
                for i in idx:  # no batch updates of per-CPU arrays on this kernel: one by one
                    self.put(ctypes.c_uint32(chunk * self.CHUNK + i), SvcCounters())

    def delete(self, key: ctypes.c_uint32) -> bool:
        """A deleted service's counters stay until its id is reused (put() resets them):
        unpointing the id would cost the kernel's RCU wait, and the chunk stays anyway."""
        return True

    def get(self, key: ctypes.c_uint32) -> list[SvcCounters] | None:
        fd = self._array_of(key.value)
        if fd is None:
            return None
        buf = (ctypes.c_uint8 * (self._stride * self.ncpu))()
        idx = ctypes.c_uint32(key.value % self.CHUNK)
        if bpfsys.lib().bpf_map_lookup_elem(fd, ctypes.byref(idx), ctypes.byref(buf)) < 0:
            return None
        raw = bytes(buf)
        return [SvcCounters.from_buffer_copy(raw, i * self._stride) for i in range(self.ncpu)]


@dataclass
class Maps:
    """The datapath's pinned maps in one pin directory."""

    pin_dir: str
    services: BpfMap[SvcKey, SvcValue]
    backends: BpfMap[ctypes.c_uint32, BackendValue]
    maglev: BpfMap[MaglevKey, MaglevChunk]
    conntrack: BpfMap[CtKey, CtEntry]
    masq_ports: BpfMap
    frags: BpfMap[FragKey, FragValue]
    affinity: BpfMap[AffinityKey, AffinityValue]
    src_ranges: BpfMap
    svc_stats: SvcStats
    dp_stats: BpfMap
    config: BpfMap
    front_filter: BpfMap      # both families' (loader/filters.py)
    backend_filter: BpfMap
    # The IPv6 family's maps (maps.h: the same layouts with 16-byte addresses).
    services6: BpfMap[SvcKey6, SvcValue]
    backends6: BpfMap[ctypes.c_uint32, BackendValue6]
    conntrack6: BpfMap[CtKey6, CtEntry6]
    masq_ports6: BpfMap
    frags6: BpfMap[FragKey6, FragValue6]
    affinity6: BpfMap[AffinityKey6, AffinityValue6]
    src_ranges6: BpfMap
    config6: BpfMap

    @classmethod
    def open(cls, pin_dir: str = DEFAULT_PIN_DIR) -> "Maps":
        if not os.path.isdir(pin_dir):
            raise KxlbError(f"no datapath pinned at {pin_dir} (run `kxlb load --iface IF` first)")
        from .mapspec import current_pin

        p = lambda name: os.path.join(pin_dir, current_pin(name))  # noqa: E731: this build's pin of a map
        return cls(
            pin_dir=pin_dir,
            services=BpfMap(p("services"), SvcKey, SvcValue),
            backends=BpfMap(p("backends"), ctypes.c_uint32, BackendValue),
            maglev=BpfMap(p("maglev"), MaglevKey, MaglevChunk),
            conntrack=BpfMap(p("conntrack"), CtKey, CtEntry),
            masq_ports=BpfMap(p("masq_ports"), ctypes.c_uint32, MasqEntry),
            frags=BpfMap(p("frags"), FragKey, FragValue),
            affinity=BpfMap(p("affinity"), AffinityKey, AffinityValue),
            src_ranges=BpfMap(p("src_ranges"), SrcRangeKey, ctypes.c_uint8),
            svc_stats=SvcStats(p("svc_stats")),
            dp_stats=BpfMap(p("dp_stats"), ctypes.c_uint32, ctypes.c_uint64, percpu=True),
            config=BpfMap(p("config"), ctypes.c_uint32, LbConfig),
            front_filter=BpfMap(p("front_filter"), ctypes.c_uint32, ctypes.c_uint64),
            backend_filter=BpfMap(p("backend_filter"), ctypes.c_uint32, ctypes.c_uint64),
            services6=BpfMap(p("services6"), SvcKey6, SvcValue),
            backends6=BpfMap(p("backends6"), ctypes.c_uint32, BackendValue6),
            conntrack6=BpfMap(p("conntrack6"), CtKey6, CtEntry6),
            masq_ports6=BpfMap(p("masq_ports6"), ctypes.c_uint32, MasqEntry6),
            frags6=BpfMap(p("frags6"), FragKey6, FragValue6),
            affinity6=BpfMap(p("affinity6"), AffinityKey6, AffinityValue6),
            src_ranges6=BpfMap(p("src_ranges6"), SrcRangeKey6, ctypes.c_uint8),
            config6=BpfMap(p("config6"), ctypes.c_uint32, LbConfig6),
        )

    def close(self) -> None:
        for m in (self.services, self.backends, self.maglev, self.conntrack, self.masq_ports, self.frags, self.affinity,
                  self.src_ranges, self.svc_stats, self.dp_stats, self.config, self.front_filter,
                  self.backend_filter, self.services6, self.backends6,
                  self.conntrack6, self.masq_ports6, self.frags6, self.affinity6, self.src_ranges6, self.config6):
            m.close()

    def __enter__(self) -> "Maps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
