"""Maglev lookup tables for backend choice (Eisenbud et al., "Maglev: A Fast and Reliable
Software Network Load Balancer", NSDI 2016, section 3.4), as the datapath reads them
(bpf/lb.h lb_table_slot(): table[table_index(flow hash, M)] -> slot -> backend).

Why Maglev: with ``hash % N`` a change from N to N+1 backends moves N/(N+1) of the hash
space (75% for 3 -> 4), so every flow without conntrack state (a node restart, an LRU
eviction, an ECMP change sending the flow to another node) lands elsewhere. A Maglev
table moves close to 1/(N+1), and gives every backend M/N entries, +-1.

Every node must compute the same table for the same backend set: a flow that moves to
another node picks the same backend there. So a backend's place in the table comes only
from its identity (``address:port``, hashed with a fixed key), never from the order of
the set, a node's history, or Python's per-process ``hash()``.

Table size (M, prime). Memory and the time to fill a table both grow with M, and
kube-proxy's scale is tens of thousands of service ports with a few endpoints each plus
a few with thousands. A small set gets a small table: M is the smallest prime of
TABLE_LADDER that is at least TABLE_FACTOR x N, else the configured maximum
(``--maglev-table-size``, default 16381): a pure function of N, so every node agrees.
Crossing a rung (15 -> 16 and 63 -> 64 backends) rebuilds the table at the new size and
moves most flows once, as ``hash % N`` did on every change. Maglev moves more than the
ideal 1/N when M/N is small: measured (tests/test_maglev.py, bench/maglev.py) about 1.1x
the ideal for 3 -> 4 backends in 251 entries, 1.5x for 10 -> 11, 2.5x for 100 -> 101 in
16381 (less in 65521).
"""
from __future__ import annotations

import socket
from array import array
from functools import lru_cache
from typing import Sequence

from . import _maglev
from .errors import KxlbError
from .layout import C, Backend

CHUNK = C["MAGLEV_CHUNK"]
MAX_TABLE = C["MAGLEV_MAX_TABLE"]       # svc_value.table_size is a u16
DEFAULT_TABLE_SIZE = 16381             # the largest table by default (Cilium's default M)
TABLE_LADDER = (251, 1021)             # small tables for small sets; above them, the maximum
TABLE_FACTOR = 16                      # a set of N backends gets M >= 16 N (up to the maximum)


def table_index(flow_hash: int, m: int) -> int:
    """The entry of a table of ``m`` entries that a flow with this 32-bit hash reads:
    bpf/hash.h kx_range(), the hash scaled onto 0..m-1 by a multiply and a shift (the
    datapath divides nowhere), so every entry is read by an equal share of flows."""
    return (flow_hash * m) >> 32


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def check_table_size(m: int, what: str = "--maglev-table-size") -> int:
    """``m`` if it can be a largest table size, else a KxlbError saying why."""
    if not isinstance(m, int) or isinstance(m, bool):
        raise KxlbError(f"{what} {m!r}: expected a prime number")
    if not 251 <= m <= MAX_TABLE:
        raise KxlbError(f"{what} {m}: must be a prime between 251 and {MAX_TABLE} (the table size is a u16)")
    if not is_prime(m):
        raise KxlbError(f"{what} {m}: not a prime (Maglev needs a prime table size; e.g. 16381, 65521)")
    return m


def table_size(n: int, max_size: int = DEFAULT_TABLE_SIZE) -> int:
    """M for a set of ``n`` backends: 0 for at most one backend (no table: slot 0). A set
    too large for ``max_size`` (M must exceed N) gets the largest table a u16 holds
    rather than no service at all: kube-proxy serves every endpoint."""
    if n <= 1:
        return 0
    for m in TABLE_LADDER:
        if m >= max_size:
            break
        if m >= TABLE_FACTOR * n:
            return m
    return max_size if n < max_size else MAX_TABLE


def identity(b: Backend) -> bytes:
    """What a backend's place in a table derives from: its address and port as the
    datapath stores them (network order), nothing a node could see differently."""
    return socket.inet_pton(socket.AF_INET6 if ":" in b.addr else socket.AF_INET, b.addr) + b.port.to_bytes(2, "big")


def populate(idents: Sequence[bytes], m: int) -> bytes:
    """The Maglev table for backends of these identities (in slot order): M uint16 in
    host order, entry -> slot. The paper's algorithm: backend i walks its permutation
    (offset_i + j * skip_i) mod M, and in turn each backend takes the next entry of its
    permutation still free, until all M are taken; so each gets M/N entries +-1, and one
    backend more or less disturbs few others' entries. Turns go in identity order, so the
    table does not depend on the order a node received the endpoints in. The hashing and
    the fill are C (loader/_maglev.c): in Python they were most of a full sync."""
    if not is_prime(m):
        raise ValueError(f"a Maglev table needs a prime size, not {m}")
    return _maglev.fill(m, idents)


def permutation(ident: bytes, m: int) -> tuple[int, int]:
    """(offset, skip) of a backend's permutation of a table of ``m`` entries."""
    return _maglev.permutation(m, ident)


@lru_cache(maxsize=1024)
def _table_bytes(backends: tuple[Backend, ...], m: int) -> bytes:
    return populate([identity(b) for b in backends], m)


def lookup_table(backends: Sequence[Backend], m: int) -> list[int]:
    """Entry -> slot (the position of its backend in ``backends``, as backend_map holds
    the set); cached by (backends, M) for readers that ask about the same set again (the
    tests, bench/maglev.py). Writers fill from their packed slots (``packed_chunks``),
    uncached: one fill takes microseconds."""
    return array("H", _table_bytes(tuple(backends), m)).tolist()


def _padded(raw: bytes, m: int) -> bytes:
    """A table of M entries padded with zeros (never read) to whole chunks."""
    return raw.ljust(n_chunks(m) * 2 * CHUNK, b"\0")


def chunks(backends: Sequence[Backend], m: int) -> list[bytes]:
    """The table as maglev_map values: CHUNK u16 slot numbers each (host order, as the
    datapath reads them), the last padded with zeros it never reads."""
    raw, step = _padded(_table_bytes(tuple(backends), m), m), 2 * CHUNK
    return [raw[i:i + step] for i in range(0, len(raw), step)]


def packed_chunks(records: bytes, stride: int, ident_len: int, m: int) -> bytes:
    """``chunks()`` joined, for the backends whose identities are the first ``ident_len``
    bytes of each ``stride``-byte record (backend_map values as a writer packs them, in
    slot order): the writers' path, with no object per backend."""
    return _padded(_maglev.fill_packed(m, records, stride, ident_len), m)


def n_chunks(m: int) -> int:
    return -(-m // CHUNK)
