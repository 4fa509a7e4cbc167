"""Programming services into the pinned maps, in an order that never shows a packet a
half-written service (see bpf/maps.h for the generation scheme).

Every change validates first and writes second; a write the kernel refuses is rolled
back, so a failed command leaves the maps as they were.
"""
from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Iterable

from . import bpfsys
from .errors import KxlbError
from .layout import (C, Backend, BackendKey, LbConfig, ServiceKey, SvcCounters, SvcValue, ip_to_raw,
                     parse_ipv4)
from .maps import Maps

MAX_PER_SVC = C["MAX_BACKENDS_PER_SVC"]

# struct layouts of maps.h for bulk packing (network-order fields as raw bytes / "!H");
# tests/test_layout.py checks them against the ctypes mirrors.
_BACKEND_KEY = struct.Struct("=IHBB")     # struct backend_key
_BACKEND = struct.Struct("=4s2sH")       # struct backend
_SVC_KEY = struct.Struct("=4s2sBB")       # struct svc_key
_SVC_VALUE = struct.Struct("=IHBB")       # struct svc_value


@dataclass(frozen=True)
class ServiceState:
    """A service as the datapath sees it."""

    key: ServiceKey
    svc_id: int
    gen: int
    backends: tuple[Backend, ...]


def validate_backends(key: ServiceKey, backends: Iterable[Backend]) -> tuple[Backend, ...]:
    seen: set[Backend] = set()
    out = []
    for b in backends:
        if b in seen:
            raise KxlbError(f"service {key}: duplicate backend {b}")
        seen.add(b)
        out.append(b)
    if len(out) > MAX_PER_SVC:
        raise KxlbError(f"service {key}: {len(out)} backends, at most {MAX_PER_SVC} per service")
    return tuple(out)


class ServiceTable:
    """Reads and writes services in one pinned datapath."""

    def __init__(self, maps: Maps):
        self.maps = maps
        # Read from the maps on first use, then kept up to date by our own writes, so a
        # long-lived writer (the controller) never rescans the maps per change.
        self._ids: set[int] | None = None
        self._slots_used: int | None = None

    def forget_counts(self) -> None:
        """Re-read ids and slot usage from the maps on next use."""
        self._ids = self._slots_used = None

    def _used_ids(self) -> set[int]:
        if self._ids is None:
            self._ids = {v.svc_id for _, v in self.maps.services.items()}
        return self._ids

    def _slot_count(self) -> int:
        if self._slots_used is None:
            self._slots_used = len(self.maps.backends.items())
        return self._slots_used

    # --- reading ------------------------------------------------------------------------
    def _slots_by_id(self) -> dict[tuple[int, int], dict[int, Backend]]:
        slots: dict[tuple[int, int], dict[int, Backend]] = {}
        for k, v in self.maps.backends.items():
            slots.setdefault((k.svc_id, k.gen), {})[k.slot] = Backend.from_c(v)
        return slots

    def read_all(self) -> dict[ServiceKey, ServiceState]:
        slots = self._slots_by_id()
        out = {}
        for k, v in self.maps.services.items():
            key = ServiceKey.from_c(k)
            got = slots.get((v.svc_id, v.gen), {})
            out[key] = ServiceState(key, v.svc_id, v.gen, tuple(got[i] for i in range(v.count) if i in got))
        return out

    def get(self, key: ServiceKey) -> ServiceState | None:
        v = self.maps.services.get(key.to_c())
        if v is None:
            return None
        bs = []
        for i in range(v.count):
            b = self.maps.backends.get(BackendKey(svc_id=v.svc_id, slot=i, gen=v.gen))
            if b is not None:
                bs.append(Backend.from_c(b))
        return ServiceState(key, v.svc_id, v.gen, tuple(bs))

    # --- writing ------------------------------------------------------------------------
    def _free_svc_id(self) -> int:
        used = self._used_ids()
        capacity = self.maps.services.max_entries
        if len(used) >= capacity - 1:  # svc_id 0 is never used
            raise KxlbError(f"service map full: {len(used)} of {capacity - 1} services")
        return next(i for i in range(1, capacity) if i not in used)

    def _check_slot_capacity(self, adding: int) -> None:
        used = self._slot_count()
        if used + adding > self.maps.backends.max_entries:
            raise KxlbError(f"backend map full: {used} of {self.maps.backends.max_entries} slots used, "
                            f"{adding} more needed")

    def _write_slots(self, key: ServiceKey, svc_id: int, gen: int, backends: tuple[Backend, ...]) -> list[BackendKey]:
        items = [(BackendKey(svc_id=svc_id, slot=i, gen=gen), b.to_c()) for i, b in enumerate(backends)]
        try:
            self.maps.backends.put_many(items)
        except OSError as exc:
            self._delete_slots(svc_id, gen, len(items), written=False)
            raise KxlbError(f"service {key}: writing backends failed: {exc}") from None
        if self._slots_used is not None:
            self._slots_used += len(items)
        return [k for k, _ in items]

    def _delete_slots(self, svc_id: int, gen: int, count: int, written: bool = True) -> None:
        gone = sum(self.maps.backends.delete(BackendKey(svc_id=svc_id, slot=i, gen=gen)) for i in range(count))
        if written and self._slots_used is not None:
            self._slots_used -= gone

    def add(self, key: ServiceKey, backends: Iterable[Backend]) -> ServiceState:
        backends = validate_backends(key, backends)
        if self.maps.services.get(key.to_c()) is not None:
            raise KxlbError(f"service {key} already exists (use `service set-backends`)")
        svc_id = self._free_svc_id()
        self._check_slot_capacity(len(backends))
        # 1. fresh counters, 2. slots, 3. the service entry that makes them reachable.
        self.maps.svc_stats.put(ctypes.c_uint32(svc_id), SvcCounters())
        self._write_slots(key, svc_id, 0, backends)
        try:
            self.maps.services.put(key.to_c(), SvcValue(svc_id=svc_id, count=len(backends), gen=0),
                                   bpfsys.BPF_NOEXIST)
        except OSError as exc:
            self._delete_slots(svc_id, 0, len(backends))
            raise KxlbError(f"service {key}: writing the service entry failed: {exc}") from None
        self._used_ids().add(svc_id)
        return ServiceState(key, svc_id, 0, backends)

    def add_many(self, services: dict[ServiceKey, Iterable[Backend]]) -> list[ServiceState]:
        """Add many new services with two batch writes (all slots, then all entries):
        a full sync's path. Validates everything before writing anything."""
        checked = {k: validate_backends(k, bs) for k, bs in services.items()}
        clash = next((k for k in checked if self.maps.services.get(k.to_c()) is not None), None)
        if clash is not None:
            raise KxlbError(f"service {clash} already exists")
        used = self._used_ids()
        capacity = self.maps.services.max_entries
        if len(used) + len(checked) > capacity - 1:
            raise KxlbError(f"service map full: {len(used)} of {capacity - 1} services used, "
                            f"{len(checked)} more needed")
        free = (i for i in range(1, capacity) if i not in used)
        states = [ServiceState(k, next(free), 0, bs) for k, bs in checked.items()]
        self._check_slot_capacity(sum(len(s.backends) for s in states))
        # Packed with struct, not one ctypes object per entry: a full sync writes ~100k.
        slot_keys = b"".join(_BACKEND_KEY.pack(s.svc_id, i, 0, 0) for s in states for i in range(len(s.backends)))
        slot_vals = b"".join(_BACKEND.pack(socket.inet_aton(b.addr), b.port.to_bytes(2, "big"), 0)
                             for s in states for b in s.backends)
        n_slots = sum(len(s.backends) for s in states)
        svc_keys = b"".join(_SVC_KEY.pack(socket.inet_aton(s.key.vip), s.key.port.to_bytes(2, "big"), s.key.proto, 0)
                            for s in states)
        svc_vals = b"".join(_SVC_VALUE.pack(s.svc_id, len(s.backends), 0, 0) for s in states)
        try:
            self.maps.backends.put_many_raw(slot_keys, slot_vals, n_slots)
            self.maps.services.put_many_raw(svc_keys, svc_vals, len(states))
        except OSError as exc:
            for s in states:
                self.maps.services.delete(s.key.to_c())
                self._delete_slots(s.svc_id, 0, len(s.backends), written=False)
            raise KxlbError(f"adding {len(states)} services failed: {exc}") from None
        used.update(s.svc_id for s in states)
        if self._slots_used is not None:
            self._slots_used += n_slots
        return states

    def set_backends(self, key: ServiceKey, backends: Iterable[Backend]) -> ServiceState:
        backends = validate_backends(key, backends)
        cur = self.maps.services.get(key.to_c())
        if cur is None:
            raise KxlbError(f"service {key} does not exist (use `service add`)")
        old_gen, old_count, svc_id = cur.gen, cur.count, cur.svc_id
        new_gen = 1 - old_gen
        self._check_slot_capacity(len(backends))
        # 1. new generation, invisible until 2. the entry flips count+gen in one update;
        # 3. the old generation goes.
        self._write_slots(key, svc_id, new_gen, backends)
        try:
            self.maps.services.put(key.to_c(), SvcValue(svc_id=svc_id, count=len(backends), gen=new_gen,
                                                        flags=cur.flags), bpfsys.BPF_EXIST)
        except OSError as exc:
            self._delete_slots(svc_id, new_gen, len(backends))
            raise KxlbError(f"service {key}: switching to the new backends failed: {exc}") from None
        self._delete_slots(svc_id, old_gen, old_count)
        return ServiceState(key, svc_id, new_gen, backends)

    def delete(self, key: ServiceKey) -> None:
        cur = self.maps.services.get(key.to_c())
        if cur is None:
            raise KxlbError(f"service {key} does not exist")
        # The entry first: from here no new flow can reach the slots.
        self.maps.services.delete(key.to_c())
        self._delete_slots(cur.svc_id, cur.gen, cur.count)
        self._used_ids().discard(cur.svc_id)

    # --- masquerade ---------------------------------------------------------------------
    def set_masquerade(self, snat_addr: str | None, cluster_cidr: str | None) -> None:
        """When to masquerade new flows (bpf/maps.h struct lb_config): to ``snat_addr``
        for hairpin flows and, with ``cluster_cidr``, for clients outside it."""
        cfg = LbConfig()
        if snat_addr:
            cfg.snat_addr = ip_to_raw(parse_ipv4(snat_addr, "masquerade address"))
        if cluster_cidr:
            try:
                net = ipaddress.IPv4Network(cluster_cidr)
            except ValueError:
                raise KxlbError(f"cluster CIDR {cluster_cidr!r} is not an IPv4 network") from None
            cfg.cluster_cidr = ip_to_raw(str(net.network_address))
            cfg.cluster_mask = ip_to_raw(str(net.netmask))
        self.maps.config.put(ctypes.c_uint32(0), cfg)

    # --- counters -----------------------------------------------------------------------
    def counters(self, svc_id: int) -> SvcCounters:
        total = SvcCounters()
        for c in self.maps.svc_stats.get(ctypes.c_uint32(svc_id)) or []:
            for name, _ in SvcCounters._fields_:
                setattr(total, name, getattr(total, name) + getattr(c, name))
        return total
