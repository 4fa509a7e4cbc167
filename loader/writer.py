"""Opening a pin directory to write its services: the writer lock (loader/lock.py), then
the repair of whatever a killed writer left (loader/journal.py), then the maps."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .errors import KxlbError
from .journal import Journal, Swept
from .lock import WriterLock
from .maps import Maps
from .registry import Registry
from .svcids import SvcIds

log = logging.getLogger("kxlb.loader")


@dataclass
class Writer:
    maps: Maps
    journal: Journal
    lock: WriterLock
    repaired: Swept | None   # what the previous writer left and this one repaired
    ids: SvcIds | None       # the service id bitmap (None: a directory without kxlb's registry)


@contextmanager
def writing(pin_dir: str, wait: float = 0.0, what: str = "") -> Iterator[Writer]:
    """Hold ``pin_dir`` for writing for the duration of the block (``wait``: seconds to
    wait for another writer; ``what``: a long-lived writer's description)."""
    import os

    if not os.path.isdir(pin_dir):
        raise KxlbError(f"no datapath pinned at {pin_dir} (run `kxlb load --iface IF` first)")
    lock = WriterLock(pin_dir).acquire(wait, what=what)
    try:
        with Registry(pin_dir) as reg, Maps.open(pin_dir) as maps:
            journal = Journal(reg)
            ids = SvcIds(pin_dir, reg, maps.svc_stats.max_entries) if reg.fd >= 0 else None
            repaired = journal.repair(maps)
            if repaired is not None:
                log.warning("%s: a writer was killed in the middle of a change; repaired: %s", pin_dir, repaired)
                if ids is not None:
                    ids.distrust()  # rebuilt from the frontend maps by the next add
            try:
                yield Writer(maps, journal, lock, repaired, ids)
            finally:
                if ids is not None:
                    ids.close()
    finally:
        lock.release()
