"""Applying a desired state to the maps: only the difference, each service atomically.

Holds what it last wrote (adopted from the pinned maps at start), so a change costs
map writes for the services that changed and nothing else. `reconcile()` compares the
maps themselves with that record and rewrites whatever was altered behind our back.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceState, ServiceTable

log = logging.getLogger("kxlb.controller")
UDP = socket.IPPROTO_UDP


@dataclass
class ApplyResult:
    added: int = 0
    updated: int = 0
    deleted: int = 0
    failed: list[str] = field(default_factory=list)
    udp_removed: dict[ServiceKey, set[Backend]] = field(default_factory=dict)  # flows to flush

    @property
    def changed(self) -> int:
        return self.added + self.updated + self.deleted


class Programmer:
    def __init__(self, maps: Maps):
        self.table = ServiceTable(maps)
        self.current: dict[ServiceKey, ServiceState] = self.table.read_all()

    def apply(self, desired: dict[ServiceKey, tuple[Backend, ...]],
              owners: dict[ServiceKey, str] | None = None,
              scope: set[ServiceKey] | None = None) -> ApplyResult:
        """Make the maps hold ``desired``. With ``scope``, only those keys are looked at
        (an incremental sync: the keys of the services that changed); without, every key
        (a full sync: anything in the maps and not desired goes)."""
        owners = owners or {}
        res = ApplyResult()
        keys = scope if scope is not None else set(self.current) | set(desired)
        # Deletions first: they free room for what comes next.
        for key in [k for k in keys if k in self.current and k not in desired]:
            try:
                self.table.delete(key)
                res.deleted += 1
                if key.proto == UDP:
                    res.udp_removed[key] = set(self.current[key].backends)
            except KxlbError as exc:
                res.failed.append(str(exc))
            self.current.pop(key, None)
        for key in keys:
            cur, backends = self.current.get(key), desired.get(key)
            if cur is not None and backends is not None and cur.backends != backends:
                try:
                    self.current[key] = self.table.set_backends(key, backends)
                    res.updated += 1
                    if key.proto == UDP:
                        res.udp_removed[key] = set(cur.backends) - set(backends)
                except KxlbError as exc:
                    res.failed.append(f"{owners.get(key, key)}: {exc}")
        new = {k: desired[k] for k in keys if k in desired and k not in self.current}
        if new:
            try:
                states = self.table.add_many(new)
            except KxlbError:
                states = self._add_one_by_one(new, owners, res)
            for st in states:
                self.current[st.key] = st
            res.added += len(states)
        return res

    def _add_one_by_one(self, new, owners, res: ApplyResult) -> list[ServiceState]:
        """The batch was refused (a full map, a service too large): add what fits."""
        states = []
        for key, backends in new.items():
            try:
                states.append(self.table.add(key, backends))
            except KxlbError as exc:
                res.failed.append(f"{owners.get(key, key)}: {exc}")
        return states

    def reconcile(self) -> list[ServiceKey]:
        """Rewrite every service whose map content differs from what we wrote (an entry
        deleted, altered or added by hand). Returns the keys repaired."""
        actual = self.table.read_all()
        repaired = []
        for key, want in list(self.current.items()):
            got = actual.get(key)
            if got is not None and got.backends == want.backends and got.svc_id == want.svc_id:
                continue
            log.warning("drift: %s in the maps is %s, expected %s; repairing", key,
                        got.backends if got else "missing", want.backends)
            try:
                if got is None:  # the entry is gone: add it afresh
                    self.current[key] = self.table.add(key, want.backends)
                else:
                    self.current[key] = self.table.set_backends(key, want.backends)
                repaired.append(key)
            except KxlbError as exc:
                log.error("drift repair of %s failed: %s", key, exc)
        for key in actual.keys() - self.current.keys():
            log.warning("drift: %s is in the maps but not in the cluster; removing", key)
            self.table.delete(key)
            repaired.append(key)
        self.table.forget_counts()  # hand edits may have changed them
        return repaired
