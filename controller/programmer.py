"""Applying a desired state to the maps: only the difference, each service port
atomically (loader/services.py keeps the write order).

The table remembers what it last wrote (adopted from the pinned maps at start), so a
change costs map writes for the service ports that changed and nothing else.
`reconcile()` compares the maps themselves with that record and rewrites whatever was
altered behind our back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from kxlb.loader import maglev
from kxlb.loader.errors import FrontendConflict, KxlbError, MapWriteError
from kxlb.loader.layout import ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceState, ServiceTable
from kxlb.loader.svcspec import LbService

log = logging.getLogger("kxlb.controller")


@dataclass
class ApplyResult:
    added: int = 0
    updated: int = 0
    deleted: int = 0
    failed: list[str] = field(default_factory=list)
    transient: bool = False   # some failure was a refused map write: worth a retry soon

    @property
    def changed(self) -> int:
        return self.added + self.updated + self.deleted


class Programmer:
    def __init__(self, maps: Maps, maglev_table_size: int = maglev.DEFAULT_TABLE_SIZE, journal=None, ids=None):
        self.table = ServiceTable(maps, maglev_table_size, journal, ids=ids)
        # Service ports programmed without some frontends another service port holds:
        # tried whole again on every sync, so they get them once the holder lets go.
        self.trimmed: dict[ServiceKey, LbService] = {}

    @property
    def current(self) -> dict[ServiceKey, ServiceState]:
        return self.table.states

    def apply(self, desired: dict[ServiceKey, LbService], scope: set[ServiceKey] | None = None) -> ApplyResult:
        """Make the maps hold ``desired``. With ``scope``, only those keys are looked at
        (an incremental sync: the keys of the services that changed); without, every key
        (a full sync: anything in the maps and not desired goes)."""
        res = ApplyResult()
        current = self.current
        keys = scope if scope is not None else set(current) | set(desired)
        retry_trimmed = {k: s for k, s in self.trimmed.items() if k not in keys}
        for k in keys:
            self.trimmed.pop(k, None)
        # Deletions first: they free room (and frontends) for what comes next.
        for key in [k for k in keys if k in current and k not in desired]:
            try:
                self.table.delete(key)
                res.deleted += 1
            except KxlbError as exc:
                res.failed.append(str(exc))
                res.transient |= isinstance(exc, MapWriteError)
        retry: list[LbService] = []
        for key in keys:
            cur, want = current.get(key), desired.get(key)
            if cur is None or want is None or cur.spec == want.canonical():
                continue
            try:
                self.table.put(want)
                res.updated += 1
            except KxlbError:
                retry.append(want)  # a frontend may be freed by a later update of this sync
        new = [desired[k] for k in keys if k in desired and k not in current]
        if new:
            try:
                res.added += len(self.table.add_many(new))
            except KxlbError:
                retry = new + retry  # one by one: what fits goes in, the rest is reported
        for spec in retry + list(retry_trimmed.values()):
            existed, again = spec.key in self.current, spec.key in retry_trimmed
            if self._put_trimming(spec, res, report=not again) and not again:
                if existed:
                    res.updated += 1
                else:
                    res.added += 1
        return res

    def _put_trimming(self, spec: LbService, res: ApplyResult, report: bool = True) -> bool:
        """put(); frontends that another service port holds are left out (reported, and
        tried again on every sync) rather than failing the whole service port: kube-proxy
        serves such a clash too (one of the two wins), never neither."""
        try:
            self.table.put(spec)
            return True
        except FrontendConflict as exc:
            if report:
                res.failed.append(f"{exc} (left out)")
            taken = set(exc.frontends)
            if any(fe.key == spec.key for fe in taken):
                return False  # its own cluster IP: nothing to serve without it
            self.trimmed[spec.key] = spec
            try:
                self.table.put(replace(spec, frontends=tuple(f for f in spec.frontends if f not in taken)))
                return True
            except KxlbError as exc2:
                res.failed.append(f"{spec.label}: {exc2}")
        except KxlbError as exc:
            res.failed.append(f"{spec.label}: {exc}")
            res.transient |= isinstance(exc, MapWriteError)
        return False

    def drift(self, keys: list[ServiceKey], entries) -> list[str]:
        """What differs in the maps from what this table wrote, among the service ports
        ``keys`` and the frontend entries ``entries`` (of table.frontend_snapshot()), each
        described; [] when the maps hold what was written. A piece of the drift check that
        controller/sweep.py spreads over the full-sync period; reconcile() repairs."""
        return [str(k) for k in self.table.drifted(keys)] + self.table.stray_entries(entries)

    def reconcile(self, just_read: bool = False) -> list[ServiceKey]:
        """Rewrite every service port whose map content differs from what we wrote (an
        entry deleted, altered or added by hand). Returns the keys repaired.

        ``just_read``: the last apply() began by reading the maps (a new table, or one
        told to forget) and compared them with the desired state; that was the repair,
        so only the cluster IPs' markers are left to check. Reading every map again costs
        seconds at 20k Services, and changes would wait for it."""
        if just_read:
            self.table.sync_markers()
            return []
        want = {k: st.spec for k, st in self.current.items()}
        actual = self.table.reload()
        repaired = []
        for key in actual.keys() - want.keys():
            log.warning("drift: %s is in the maps but not in the cluster; removing", key)
            self.table.delete(key)
            repaired.append(key)
        for key, spec in want.items():
            got = actual.get(key)
            if got is not None and got.spec == spec:
                continue
            log.warning("drift: %s in the maps is %s, expected %s; repairing", key,
                        got.spec if got else "missing", spec)
            try:
                self.table.put(spec)
                repaired.append(key)
            except KxlbError as exc:
                log.error("drift repair of %s failed: %s", key, exc)
        self.table.sync_markers()
        return repaired
