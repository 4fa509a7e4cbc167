"""Carrying a map's contents into a map of another capacity or layout version.

An upgrade that changes a pinned map (its capacity, or its layout: a new version in its
pin name, loader/mapspec.py) builds the new map beside the old one and copies every
entry across (loader/datapath.py), converting entries between layout versions with the
converters registered here. Conntrack is copied too, so established flows keep their
backend and their reverse NAT across the upgrade.

A converter takes every entry of the old map (key bytes, value bytes) and writes the new
layout's entries through a Targets: into the map itself, and into maps the new layout
adds (conntrack's layout 2 puts a masqueraded flow's port into masq_ports). One is
registered per step (base name, version, version + 1), and one per step back for `kxlb
downgrade` (version + 1 to version); a chain of them spans several releases.
tests/test_layout.py checks that every stateful map with an older released layout
(bpf/layouts.txt) has a path to this build's version, unless it is declared DISPOSABLE
(state the datapath rebuilds on its own).
"""
from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from . import bpfsys
from .errors import KxlbError

Entry = tuple[bytes, bytes]
Converter = Callable[[Iterable[Entry], "Targets"], None]

CONVERTERS: dict[tuple[str, int, int], Converter] = {}
"""(base name, from version, to version) -> converter, one per step up or down."""

DISPOSABLE = {"frags", "frags6"}
"""Maps whose contents may start empty after a layout change: in-flight fragment state
(a datagram whose first fragment crossed the old datapath loses its later fragments'
translation; the sender retransmits)."""

MAP_TYPE_ARRAY, MAP_TYPE_PERCPU_ARRAY, MAP_TYPE_ARRAY_OF_MAPS = 2, 6, 12
PERCPU_TYPES = {5, MAP_TYPE_PERCPU_ARRAY, 10}  # percpu hash, percpu array, lru percpu hash


def converter(base: str, frm: int, to: int):
    """Register a converter (a decorator)."""
    def register(fn: Converter) -> Converter:
        CONVERTERS[(base, frm, to)] = fn
        return fn
    return register


def path(base: str, frm: int, to: int) -> list[Converter] | None:
    """The converters from version ``frm`` to ``to`` (up or down), one per step (empty
    when equal), or None when a step has none."""
    step = 1 if to >= frm else -1
    steps = [CONVERTERS.get((base, v, v + step)) for v in range(frm, to, step)]
    return None if None in steps else steps  # type: ignore[return-value]


@dataclass
class CopyResult:
    copied: int = 0
    skipped: int = 0     # already in the new map (written by the new datapath first), or dropped
    failed: int = 0      # the new map refused them (full)


class _RawMap:
    """Entries of a map as bytes, whatever its type (per-CPU values as the kernel packs
    them, maps of maps as inner map ids in, file descriptors out)."""

    def __init__(self, fd: int):
        self.fd = fd
        info = bpfsys.map_info(fd)
        self.type, self.key_size, self.value_size = info.type, info.key_size, info.value_size
        self.max_entries = info.max_entries
        ncpu = bpfsys.possible_cpus() if self.type in PERCPU_TYPES else 1
        self.value_buf_size = ((self.value_size + 7) & ~7) * ncpu if ncpu > 1 else self.value_size

    def entries(self) -> Iterator[Entry]:
        for keys, values, n in self.batches():
            for i in range(n):
                yield (keys[i * self.key_size:(i + 1) * self.key_size],
                       values[i * self.value_buf_size:(i + 1) * self.value_buf_size])

    def count(self) -> int:
        return sum(n for *_, n in self.batches())

    def batches(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(keys, values, n) in batches where the kernel has batch lookups for the map
        type, else one entry at a time."""
        try:
            yield from bpfsys.lookup_batches(self.fd, self.key_size, self.value_buf_size)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, bpfsys.ENOTSUPP):
                raise
            yield from self._one_by_one()

    def _one_by_one(self) -> Iterator[tuple[bytes, bytes, int]]:
        lib = bpfsys.lib()
        key, nxt = ctypes.create_string_buffer(self.key_size), ctypes.create_string_buffer(self.key_size)
        val = ctypes.create_string_buffer(self.value_buf_size)
        first = True
        while lib.bpf_map_get_next_key(self.fd, None if first else key, nxt) >= 0:
            first = False
            ctypes.memmove(key, nxt, self.key_size)
            if lib.bpf_map_lookup_elem(self.fd, key, val) < 0:
                continue  # deleted meanwhile (an LRU eviction), or an empty slot of a map of maps
            yield key.raw, val.raw, 1

    def get(self, key: bytes) -> bytes | None:
        val = ctypes.create_string_buffer(self.value_buf_size)
        if bpfsys.lib().bpf_map_lookup_elem(self.fd, key, val) < 0:
            return None
        return val.raw

    def put(self, key: bytes, value: bytes, flags: int) -> int:
        """Returns 0, or the errno of a refusal."""
        fd_to_close = -1
        if self.type == MAP_TYPE_ARRAY_OF_MAPS:  # lookups give inner map ids, updates take fds
            try:
                fd_to_close = bpfsys.map_fd_by_id(int.from_bytes(value[:4], "little"))
            except OSError as exc:
                return exc.errno
            value = fd_to_close.to_bytes(4, "little")
        try:
            ret = bpfsys.lib().bpf_map_update_elem(self.fd, key, value, flags)
        finally:
            if fd_to_close >= 0:
                os.close(fd_to_close)
        return -ret if ret < 0 else 0


class Targets:
    """Where a converter writes: the maps of the new layout by base name (the converted
    map itself, and the maps its new layout adds). ``only_new``: the second pass, after
    the new programs took over: what they wrote is newer, so an existing key is kept (a
    hash map), and an array entry is merged (``merge``: current bytes, converted bytes ->
    bytes to write)."""

    def __init__(self, maps: dict[str, "_RawMap"], only_new: bool, sources: dict[str, "_RawMap"] | None = None):
        self.maps, self.only_new = maps, only_new
        self.sources = sources or {}   # the maps converted from, by base name (read only)
        self.result = CopyResult()

    def put(self, base: str, key: bytes, value: bytes, merge: Callable[[bytes, bytes], bytes] | None = None) -> None:
        m = self.maps[base]
        array = m.type in (MAP_TYPE_ARRAY, MAP_TYPE_PERCPU_ARRAY, MAP_TYPE_ARRAY_OF_MAPS)
        if self.only_new and array and merge is not None:
            current = m.get(key)
            if current is not None:
                value = merge(current, value)
        flags = bpfsys.BPF_NOEXIST if self.only_new and not array else bpfsys.BPF_ANY
        err = m.put(key, value, flags)
        if err == 0:
            self.result.copied += 1
        elif err == errno.EEXIST:
            self.result.skipped += 1
        else:
            self.result.failed += 1

    def drop(self, n: int = 1) -> None:
        """Entries the new layout cannot hold (counted as failed)."""
        self.result.failed += n


def convert(old_fd: int, targets: Targets, steps: list[Converter]) -> CopyResult:
    """Every entry of the map ``old_fd`` through a chain of converters into ``targets``.
    A chain of more than one step passes each step's output for the converted map on to
    the next (in memory)."""
    entries: Iterable[Entry] = _RawMap(old_fd).entries()
    for i, step in enumerate(steps):
        if i == len(steps) - 1:
            step(entries, targets)
        else:
            held = _Held(targets)
            step(entries, held)
            entries = held.own
    return targets.result


class _Held(Targets):
    """A step in the middle of a chain: its output for its own map is kept for the next
    step; what it writes into other maps goes straight to the targets."""

    def __init__(self, targets: Targets):
        self.targets, self.own = targets, []
        self.maps, self.only_new, self.result = targets.maps, targets.only_new, targets.result
        self.sources = targets.sources

    def put(self, base, key, value, merge=None) -> None:
        if base == SELF:
            self.own.append((key, value))
        else:
            self.targets.put(base, key, value, merge)


SELF = ""
"""The base name a converter writes its own map's entries under."""


def copy(old_fd: int, new_fd: int, only_new: bool) -> CopyResult:
    """Copy every entry of the map ``old_fd`` into ``new_fd`` of the same layout (another
    capacity). ``only_new``: see Targets."""
    src, dst = _RawMap(old_fd), _RawMap(new_fd)
    if src.value_buf_size != dst.value_buf_size:
        raise KxlbError(f"cannot copy a map with {src.value_size}-byte values into one with {dst.value_size}")
    arrays = dst.type in (MAP_TYPE_ARRAY, MAP_TYPE_PERCPU_ARRAY, MAP_TYPE_ARRAY_OF_MAPS)
    targets = Targets({SELF: dst}, only_new)
    for key, value in src.entries():
        if arrays and int.from_bytes(key[:4], "little") >= dst.max_entries:
            targets.drop()   # an array that shrank: the index no longer exists
            continue
        targets.put(SELF, key, value)
    return targets.result


from . import ct_migrate  # noqa: E402,F401 (registers conntrack's converters: it imports this module)
from . import svc_migrate  # noqa: E402,F401 (the same for services and backends)
