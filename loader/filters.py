"""The address filters (bpf/filter.h, maps.h front_filter and backend_filter): bitmaps
that tell the datapath which packets may belong to a service or a flow, so that the
others skip every hash lookup. Set by user space, never cleared: a bit goes in before the
frontend or backend it stands for is written (ServiceTable), and a load fills them from
what the maps already hold (a first load of this layout over an older release's maps,
whose flows' frontends and backends may no longer be a service's). A stale bit only costs
a lookup.

Bits are read-modify-written one 64-bit word at a time; the writer lock makes this
process the only writer, so the words it read stay true while it holds it (bits are
only ever added), and each word is read once per process."""
from __future__ import annotations

import array
import ctypes
import socket
from typing import Iterable

from .conntrack import flows, fold, fold_packed
from .layout import C, FAMILIES, Family
from .maps import BpfMap, Maps

_MASK = 0xffffffff


def filter_bit(folded: int, port_raw: int, log: int) -> int:
    """filter.h filter_bit(): the bit of a folded address and a port (network order, as
    the field holds it; 0 for frontends)."""
    return (((folded ^ (port_raw * C["FILTER_PORT_MUL"])) & _MASK) * C["FILTER_MUL"] & _MASK) >> (32 - log)


def front_bit(fam: Family, addr: str) -> int:
    return filter_bit(fold_packed(fam, fam.pton(addr)), 0, C["FRONT_FILTER_LOG"])


def backend_bit(fam: Family, addr: str, port: int) -> int:
    return filter_bit(fold_packed(fam, fam.pton(addr)), socket.htons(port), C["BACKEND_FILTER_LOG"])


class _Bits:
    """One filter's words, read on first use and written back when set. A writer of a few
    bits (the CLI) looks its words up one by one; one that needs more than
    ``_READ_ALL`` words it has not read (a full sync: a word per backend) reads the whole
    array in one batch lookup instead (512 KB for the backend filter, a few ms)."""

    _READ_ALL = 256

    def __init__(self, m: BpfMap):
        self.map = m
        self.words: dict[int, int] = {}
        self._all: array.array | None = None   # every word, once read in one batch

    def _read_all(self) -> None:
        keys, vals, n = self.map.items_raw()
        words = array.array("Q", bytes(8 * self.map.max_entries))
        for k, v in zip(array.array("I", keys), array.array("Q", vals)):
            words[k] = v
        for k, v in self.words.items():   # what this process wrote stays true (bits only get set)
            words[k] |= v
        self._all = words

    def _word(self, word: int) -> int:
        if self._all is not None:
            return self._all[word]
        have = self.words.get(word)
        if have is None:
            got = self.map.get(ctypes.c_uint32(word))
            have = got.value if got is not None else 0
            self.words[word] = have
        return have

    def add(self, bits: Iterable[int]) -> int:
        """Set ``bits``; returns how many words changed."""
        bits = list(bits)
        if self._all is None and len({b >> 6 for b in bits} - self.words.keys()) > self._READ_ALL:
            self._read_all()
        # Every bit's word with the bit set, then only the words that changed.
        word, seen = self._word, {}
        for bit in bits:
            w = bit >> 6
            have = seen.get(w)
            seen[w] = (word(w) if have is None else have) | (1 << (bit & 63))
        changed = {w: v for w, v in seen.items() if v != word(w)}
        if changed:
            self.map.put_many_raw(b"".join(w.to_bytes(4, "little") for w in changed),
                                  b"".join(v.to_bytes(8, "little") for v in changed.values()), len(changed))
            if self._all is not None:
                for k, v in changed.items():
                    self._all[k] = v
            else:
                self.words.update(changed)
        return len(changed)


class AddressFilters:
    """Both filters of one pin directory."""

    def __init__(self, maps: Maps):
        self.fronts = _Bits(maps.front_filter)
        self.backends = _Bits(maps.backend_filter)

    def add(self, fronts: Iterable[str] = (), backends: Iterable[tuple[str, int]] = ()) -> None:
        """Frontend addresses and backend (address, port)s, any family (text)."""
        from .layout import family_of

        self.fronts.add(front_bit(family_of(a), a) for a in fronts)
        self.backends.add(backend_bit(family_of(a), a, p) for a, p in backends)

    def fill(self, maps: Maps) -> tuple[int, int]:
        """Every frontend and backend the maps name: services, slots, and tracked flows.
        Returns the number of words changed (fronts, backends)."""
        fb, bb = [], []
        for fam in FAMILIES:
            for k, _ in fam.map(maps, "services").items():
                fb.append(filter_bit(fold(fam, k.vip), 0, C["FRONT_FILTER_LOG"]))
            for _, v in fam.map(maps, "backends").items():
                bb.append(filter_bit(fold(fam, v.addr), v.port, C["BACKEND_FILTER_LOG"]))
        for f in flows(maps):
            fb.append(front_bit(f.family, f.front.addr))
            bb.append(backend_bit(f.family, f.backend.addr, f.backend.port))
        return self.fronts.add(fb), self.backends.add(bb)


__all__ = ["AddressFilters", "filter_bit", "front_bit", "backend_bit"]
