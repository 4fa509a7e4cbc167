"""The service ids in use, as a bitmap pinned beside the maps (``svc_ids``).

A writer that adds one service port (`kxlb service add`) needs a free id. Finding the
ids in use from the frontend maps means reading every frontend of the node (140,000
entries at 70k Services, ~70 ms of batch lookups before any Python runs); the bitmap is
16 KB, one lookup. Every writer of this release keeps it up to date as it adds and
deletes service ports; the controller rewrites it whole after each full read of the maps.

It is trusted only while the registry says it describes the datapath build loaded now
(the program ids of the "build" record, which every compiling load renews): a roll back
to a release that does not know the bitmap, writes by that release, and the load that
brings this one back all leave it untrusted, and the next writer rebuilds it from the
frontend maps. A repair that sweeps everything leaves it untrusted too.
"""
from __future__ import annotations

import ctypes
import os

from . import bpfsys
from .errors import KxlbError
from .registry import Registry

PIN = "svc_ids"
RECORD = "svc_ids"
WORD_BITS = 64
BPF_MAP_TYPE_ARRAY = 2


class SvcIds:
    """The bitmap of one pin directory (created with ``capacity`` ids when missing)."""

    def __init__(self, pin_dir: str, reg: Registry, capacity: int):
        self.reg, self.capacity = reg, capacity
        self.words = (capacity + WORD_BITS - 1) // WORD_BITS
        path = os.path.join(pin_dir, PIN)
        try:
            self.fd = bpfsys.obj_get(path)
        except OSError:
            self.fd = bpfsys.map_create(BPF_MAP_TYPE_ARRAY, "kxlb_svc_ids", 4, 8, self.words)
            try:
                bpfsys.obj_pin(self.fd, path)
            except OSError as exc:
                os.close(self.fd)
                raise KxlbError(f"cannot pin the service id bitmap at {path}: {exc.strerror}") from None
        info = bpfsys.map_info(self.fd)
        if (info.key_size, info.value_size) != (4, 8) or info.max_entries < self.words:
            os.close(self.fd)
            raise KxlbError(f"{path} is not a service id bitmap of {capacity} ids: remove it (`kxlb gc` rebuilds it)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- trust ---------------------------------------------------------------------------
    def _build(self) -> list | None:
        build = self.reg.get("build") or {}
        return build.get("programs")

    def trusted(self) -> bool:
        from .compile import pinned_datapath
        from .datapath import _program_ids

        doc = self.reg.get(RECORD) or {}
        programs = self._build()
        if not programs or doc.get("programs") != programs:
            return False
        try:
            dp = pinned_datapath(self.reg.pin_dir)
        except KxlbError:
            return False
        try:
            return _program_ids(dp) == programs  # not re-pinned by another release since
        finally:
            for fd in (dp.tc_fd, dp.xdp_fd, dp.tc_egress_fd):
                os.close(fd)

    def distrust(self) -> None:
        self.reg.delete(RECORD)

    # --- bits ----------------------------------------------------------------------------
    def rebuild(self, ids: set[int]) -> None:
        """Write the bitmap whole from ``ids`` and trust it."""
        words = [0] * self.words
        for i in ids:
            words[i // WORD_BITS] |= 1 << (i % WORD_BITS)
        keys = (ctypes.c_uint32 * self.words)(*range(self.words))
        vals = (ctypes.c_uint64 * self.words)(*words)
        count = ctypes.c_uint32(self.words)
        opts = bpfsys.batch_opts()
        if bpfsys.lib().bpf_map_update_batch(self.fd, keys, vals, ctypes.byref(count), ctypes.byref(opts)) < 0:
            for k in range(self.words):
                self._put(k, words[k])
        if self._build():
            self.reg.put(RECORD, {"programs": self._build()})

    def _get(self, word: int) -> int:
        v = ctypes.c_uint64()
        bpfsys.check(bpfsys.lib().bpf_map_lookup_elem(self.fd, ctypes.byref(ctypes.c_uint32(word)), ctypes.byref(v)),
                     "read the service id bitmap")
        return v.value

    def _put(self, word: int, value: int) -> None:
        bpfsys.check(bpfsys.lib().bpf_map_update_elem(self.fd, ctypes.byref(ctypes.c_uint32(word)),
                                                      ctypes.byref(ctypes.c_uint64(value)), bpfsys.BPF_ANY),
                     "write the service id bitmap")

    def free(self, n: int = 1) -> list[int]:
        """``n`` ids not in use (1..capacity-1: id 0 is never used), lowest first."""
        out = []
        for raw_word, value in self._words():
            if value == (1 << WORD_BITS) - 1:
                continue
            for b in range(WORD_BITS):
                i = raw_word * WORD_BITS + b
                if 0 < i < self.capacity and not value >> b & 1:
                    out.append(i)
                    if len(out) == n:
                        return out
        return out

    def _words(self):
        for keys, vals, n in bpfsys.lookup_batches(self.fd, 4, 8, what="the service id bitmap"):
            ks = (ctypes.c_uint32 * n).from_buffer_copy(keys)
            vs = (ctypes.c_uint64 * n).from_buffer_copy(vals)
            yield from sorted(zip(ks, vs))

    def mark(self, svc_id: int, used: bool) -> None:
        word = svc_id // WORD_BITS
        v = self._get(word)
        bit = 1 << (svc_id % WORD_BITS)
        self._put(word, v | bit if used else v & ~bit)
