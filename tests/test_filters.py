"""The address filters (loader/filters.py) as the maps hold them: a writer of a few bits
reads their words one by one, a full sync's writer reads the whole array once; either
way every bit it adds is set and no bit set before (by another writer) is lost."""
from __future__ import annotations

import array
import itertools
import socket

from kxlb.loader.conntrack import fold
from kxlb.loader.filters import AddressFilters, backend_bit, filter_bit
from kxlb.loader.layout import C, family_of


def words(m) -> dict[int, int]:
    keys, vals, _ = m.items_raw()
    return {k: v for k, v in zip(array.array("I", keys), array.array("Q", vals)) if v}


def expected(bits: dict[int, int], fronts=(), backends=()) -> tuple[dict[int, int], dict[int, int]]:
    """The words with these addresses' bits added, computed the long way: the ctypes
    address field, folded as the datapath folds it."""
    out = []
    for addrs, log in ((fronts, C["FRONT_FILTER_LOG"]), (backends, C["BACKEND_FILTER_LOG"])):
        w = dict(bits[log])
        for a in addrs:
            addr, port = a if isinstance(a, tuple) else (a, None)
            fam = family_of(addr)
            bit = filter_bit(fold(fam, fam.addr_c(addr)), socket.htons(port) if port else 0, log)
            w[bit >> 6] = w.get(bit >> 6, 0) | 1 << (bit & 63)
        out.append(w)
    return out[0], out[1]


def test_bits_added_word_by_word_and_by_a_whole_read_keep_every_earlier_bit(dp):
    _, maps = dp
    now = {C["FRONT_FILTER_LOG"]: words(maps.front_filter), C["BACKEND_FILTER_LOG"]: words(maps.backend_filter)}
    many_fronts = [f"10.96.78.{i}" for i in range(1, 200)] + ["fd00:96::78"]
    many = [(f"10.78.{i // 256}.{i % 256}", 80 + i % 7) for i in range(5000)] + \
           [(f"fd00:78::{i:x}", 443) for i in range(1000)]
    # A few (the CLI's path: words looked up one by one), whose bits share a word with one
    # of the thousands below but are not theirs: only a writer that keeps what it read
    # leaves them set.
    taken = {backend_bit(family_of(a), a, p) for a, p in many}
    shared = {t >> 6 for t in taken}
    candidates = ((f"10.77.{i // 256}.{i % 256}", 8080) for i in range(65536))
    few = list(itertools.islice(((a, p) for a, p in candidates
                                 if (b := backend_bit(family_of(a), a, p)) not in taken and b >> 6 in shared), 3))
    few_fronts = ["10.96.77.1"]
    AddressFilters(maps).add(few_fronts, few)
    fronts, backends = expected(now, few_fronts, few)
    assert words(maps.front_filter) == fronts and words(maps.backend_filter) == backends

    # Thousands, by another writer (a full sync: the whole array read at once). The bits
    # the first writer set must survive, and its own later adds too.
    f = AddressFilters(maps)
    f.add(many_fronts, many)
    more = [("10.79.0.1", 9090)]
    f.add(backends=more)
    now = {C["FRONT_FILTER_LOG"]: fronts, C["BACKEND_FILTER_LOG"]: backends}
    fronts, backends = expected(now, many_fronts, many + more)
    assert words(maps.front_filter) == fronts and words(maps.backend_filter) == backends
    # Bits already set change no word, whether read whole or word by word.
    again = [backend_bit(family_of(a), a, p) for a, p in many[:50]]
    assert f.backends.add(again) == 0 and AddressFilters(maps).backends.add(again) == 0
