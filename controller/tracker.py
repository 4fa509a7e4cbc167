"""The change tracker: kube-proxy's ServiceChangeTracker and EndpointsChangeTracker
(pkg/proxy/servicechangetracker.go, endpointschangetracker.go) as one type.

The informers' threads hand it Services and EndpointSlices as the API server sends them;
it keeps them decoded, notes which Services changed, and the sync loop checks the changes
out: the Services to model again, each with its slices, and the trigger times of the
slice changes (the network-programming latency). Pure state: no I/O, no clock, no maps;
a bad object is handed to ``on_invalid`` and the last good version kept.
"""
from __future__ import annotations

import datetime as dt
import threading
from typing import Callable, Iterable, NamedTuple

from .decode import DecodeError, decode_service, decode_slice
from .informer import DELETED
from .model import EndpointSlice, Service

TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


class Work(NamedTuple):
    """One Service to model again: None if it is gone (its fragment goes)."""

    service_id: str
    service: Service | None
    slices: list[EndpointSlice]


class ChangeTracker:
    def __init__(self, on_invalid: Callable[[DecodeError, dict], None] = lambda exc, obj: None):
        self.on_invalid = on_invalid
        self._lock = threading.Lock()
        self.services: dict[str, Service] = {}
        self.slices_by_service: dict[str, dict[str, EndpointSlice]] = {}
        self._slice_service: dict[str, str] = {}     # slice key -> its Service, to move or drop it
        self._dirty: set[str] = set()
        self._triggers: dict[str, list[float]] = {}  # Service -> trigger times of its slice changes
        self.slice_changes = 0                       # EndpointSlice events since the last checkout

    @property
    def pending(self) -> int:
        """Services changed since the last checkout."""
        return len(self._dirty)

    def service(self, typ: str, key: str, obj: dict) -> bool:
        """A Service event; False when it changed nothing (a bad object: the last good
        version stays)."""
        with self._lock:
            if typ == DELETED:
                self.services.pop(key, None)
            else:
                try:
                    self.services[key] = decode_service(obj)
                except DecodeError as exc:
                    self.on_invalid(exc, obj)
                    return False
            self._dirty.add(key)
        return True

    def slice(self, typ: str, key: str, obj: dict) -> bool:
        """An EndpointSlice event; False when it changed nothing. Endpoints or ports the
        slice cannot use are left out and reported; the rest is kept."""
        with self._lock:
            old_svc = self._slice_service.pop(key, None)
            if typ != DELETED:
                skipped: list[DecodeError] = []
                try:
                    s = decode_slice(obj, skipped)
                except DecodeError as exc:
                    self.on_invalid(exc, obj)
                    if old_svc:
                        self._slice_service[key] = old_svc
                    return False
                for exc in skipped:
                    self.on_invalid(exc, obj)
            if old_svc:
                self.slices_by_service.get(old_svc, {}).pop(key, None)
                self._dirty.add(old_svc)
            if typ != DELETED:
                self.slices_by_service.setdefault(s.service_id, {})[key] = s
                self._slice_service[key] = s.service_id
                self._dirty.add(s.service_id)
                trig = trigger_time(obj)
                if trig is not None:   # one sample per slice change, as kube-proxy's tracker
                    self._triggers.setdefault(s.service_id, []).append(trig)
            elif old_svc:
                # a deletion's trigger time is its last update's, not the change measured
                # (kube-proxy drops the Service's pending samples the same way)
                self._triggers.pop(old_svc, None)
            self.slice_changes += 1
        return True

    def checkout(self, full: bool, also: Iterable[str] = ()) -> tuple[list[Work], list[float]]:
        """What changed since the last checkout (every Service, and ``also``, if ``full``),
        and the trigger times of their slice changes; the tracker starts over."""
        with self._lock:
            ids = (set(self.services) | set(also)) if full else self._dirty
            self._dirty = set()
            self.slice_changes = 0
            work = [Work(sid, self.services.get(sid), list(self.slices_by_service.get(sid, {}).values()))
                    for sid in ids]
            triggers = [t for sid in ids for t in self._triggers.pop(sid, ())]
        return work, triggers


def trigger_time(obj: dict) -> float | None:
    """endpoints.kubernetes.io/last-change-trigger-time, in seconds since the epoch."""
    ann = ((obj.get("metadata") or {}).get("annotations") or {}).get(TRIGGER_ANNOTATION)
    if not ann:
        return None
    try:
        return dt.datetime.fromisoformat(ann.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
