"""Services and backends between their layouts: 1 (kxlb 0.1 and 0.2: slots in a hash map
keyed by (svc_id, slot, gen, set)) and 2 (slots in an array, each set a run of it that the
frontend's entry names, each slot tagged with its set: bpf/maps.h), both ways: up for a load
of this release over an older datapath, down for `kxlb downgrade`.

One converter per family does both maps: the frontend map's converter reads the other
layout's slots (``Targets.sources``) and writes the new slot map itself; the slot map's own
converter has nothing left to do. Layout 1's structs are declared here, as released.
"""
from __future__ import annotations

import struct
from typing import Iterable

from .layout import V4, V6, C, Family
from .migrate import SELF, Entry, Targets, converter

MARKER = C["KIND_MARKER"]
SVC_VALUE_V1 = struct.Struct("=IHHBBHIHH")    # struct svc_value, layout 1
RUNS = struct.Struct("=II")                   # what layout 2 appends: slots, local_slots
BACKEND_KEY_V1 = struct.Struct("=IHBB")       # struct backend_key, layout 1
INDEX = struct.Struct("=I")
TAG = struct.Struct("=H")


def _tag(svc_id: int, gen: int) -> bytes:
    from .services import slot_tag
    return TAG.pack(slot_tag(svc_id, gen))


def _up(fam: Family):
    backends = "backends" + fam.suffix
    ident = fam.addr_len + 2

    def up(entries: Iterable[Entry], targets: Targets) -> None:
        if targets.only_new:
            return  # the old programs never write services or slots
        old = targets.sources.get(backends)
        runs: dict[tuple[int, int, int, int], int] = {}
        cursor = 1
        for key, value in entries:
            svc_id, count, local_count, gen, kind, *_ = SVC_VALUE_V1.unpack(value[:SVC_VALUE_V1.size])
            if kind == MARKER:
                targets.put(SELF, key, value + RUNS.pack(0, 0))
                continue
            bases = []
            for set_, n in enumerate((count, local_count)):
                if not n:
                    bases.append(0)
                    continue
                # every frontend of a set names one run (one per variant a killed writer left)
                if (svc_id, gen, set_, n) not in runs:
                    runs[(svc_id, gen, set_, n)] = cursor
                    for i in range(n):
                        raw = old.get(BACKEND_KEY_V1.pack(svc_id, i, gen, set_)) if old is not None else None
                        if raw is not None:   # a missing slot reads as a broken set: the controller rewrites it
                            targets.put(backends, INDEX.pack(cursor + i), raw[:ident] + _tag(svc_id, gen))
                    cursor += n
                bases.append(runs[(svc_id, gen, set_, n)])
            targets.put(SELF, key, value + RUNS.pack(*bases))
    return up


def _down(fam: Family):
    backends = "backends" + fam.suffix
    ident = fam.addr_len + 2

    def down(entries: Iterable[Entry], targets: Targets) -> None:
        new = targets.sources.get(backends)
        done: set[tuple[int, int, int]] = set()
        for key, value in entries:
            v1 = value[:SVC_VALUE_V1.size]
            svc_id, count, local_count, gen, kind, *_ = SVC_VALUE_V1.unpack(v1)
            targets.put(SELF, key, v1)
            if kind == MARKER or new is None:
                continue
            for set_, (n, base) in enumerate(zip((count, local_count), RUNS.unpack(value[SVC_VALUE_V1.size:]))):
                if not n or (svc_id, gen, set_) in done:
                    continue
                done.add((svc_id, gen, set_))
                want = _tag(svc_id, gen)
                for i in range(n):
                    raw = new.get(INDEX.pack(base + i))
                    if raw is not None and raw[ident:ident + 2] == want:
                        targets.put(backends, BACKEND_KEY_V1.pack(svc_id, i, gen, set_), raw[:ident] + b"\0\0")
    return down


def _nothing(entries: Iterable[Entry], targets: Targets) -> None:
    """The slot map's own step: its frontend map's converter wrote it."""


for _fam in (V4, V6):
    converter("services" + _fam.suffix, 1, 2)(_up(_fam))
    converter("services" + _fam.suffix, 2, 1)(_down(_fam))
    converter("backends" + _fam.suffix, 1, 2)(_nothing)
    converter("backends" + _fam.suffix, 2, 1)(_nothing)
