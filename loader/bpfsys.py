"""Thin ctypes binding to libbpf for what Python needs around pinned objects:
open a pin, map element and batch operations, object info, and BPF_PROG_TEST_RUN.

libbpf (Debian's libbpf1, which BCC itself links) does the syscalls; this module only
declares signatures and turns negative returns into OSError.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import lru_cache

from .errors import KxlbError

BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2

c_int, c_uint32, c_uint64, c_void_p, c_char_p, c_size_t = (
    ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)


class BatchOpts(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("elem_flags", c_uint64), ("flags", c_uint64)]


class TestRunOpts(ctypes.Structure):
    """libbpf's struct bpf_test_run_opts."""

    _fields_ = [
        ("sz", c_size_t),
        ("data_in", c_void_p), ("data_out", c_void_p),
        ("data_size_in", c_uint32), ("data_size_out", c_uint32),
        ("ctx_in", c_void_p), ("ctx_out", c_void_p),
        ("ctx_size_in", c_uint32), ("ctx_size_out", c_uint32),
        ("retval", c_uint32), ("repeat", c_int), ("duration", c_uint32),
        ("flags", c_uint32), ("cpu", c_uint32), ("batch_size", c_uint32),
    ]


class MapInfo(ctypes.Structure):
    """Leading fields of the kernel's struct bpf_map_info (the rest is padding here)."""

    _fields_ = [
        ("type", c_uint32), ("id", c_uint32), ("key_size", c_uint32), ("value_size", c_uint32),
        ("max_entries", c_uint32), ("map_flags", c_uint32), ("name", ctypes.c_char * 16),
        ("_rest", ctypes.c_uint8 * 200),
    ]


class ProgInfo(ctypes.Structure):
    """struct bpf_prog_info up to verified_insns (Linux 5.16): the instructions the
    verifier walked to accept the program, of the 1,000,000 it walks before it refuses
    one (E2BIG). Pointer fields stay 0: the kernel then fills none of their arrays."""

    _fields_ = [
        ("type", c_uint32), ("id", c_uint32), ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", c_uint32), ("xlated_prog_len", c_uint32),
        ("jited_prog_insns", c_uint64), ("xlated_prog_insns", c_uint64), ("load_time", c_uint64),
        ("created_by_uid", c_uint32), ("nr_map_ids", c_uint32), ("map_ids", c_uint64),
        ("name", ctypes.c_char * 16), ("ifindex", c_uint32), ("gpl_compatible", c_uint32),
        ("netns_dev", c_uint64), ("netns_ino", c_uint64),
        ("nr_jited_ksyms", c_uint32), ("nr_jited_func_lens", c_uint32),
        ("jited_ksyms", c_uint64), ("jited_func_lens", c_uint64),
        ("btf_id", c_uint32), ("func_info_rec_size", c_uint32), ("func_info", c_uint64),
        ("nr_func_info", c_uint32), ("nr_line_info", c_uint32),
        ("line_info", c_uint64), ("jited_line_info", c_uint64),
        ("nr_jited_line_info", c_uint32), ("line_info_rec_size", c_uint32),
        ("jited_line_info_rec_size", c_uint32), ("nr_prog_tags", c_uint32), ("prog_tags", c_uint64),
        ("run_time_ns", c_uint64), ("run_cnt", c_uint64), ("recursion_misses", c_uint64),
        ("verified_insns", c_uint32), ("attach_btf_obj_id", c_uint32), ("attach_btf_id", c_uint32),
        ("_pad", c_uint32),
    ]


VERIFIER_INSN_LIMIT = 1_000_000
"""BPF_COMPLEXITY_LIMIT_INSNS: the instructions a kernel's verifier walks (every path it
could not prune counts again) before it refuses a program with E2BIG."""


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        so = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise KxlbError(f"cannot load libbpf ({name}): {exc}; run `make setup`") from exc
    sig = {
        "bpf_obj_get": (c_int, [c_char_p]),
        "bpf_obj_pin": (c_int, [c_int, c_char_p]),
        "bpf_map_update_elem": (c_int, [c_int, c_void_p, c_void_p, c_uint64]),
        "bpf_map_lookup_elem": (c_int, [c_int, c_void_p, c_void_p]),
        "bpf_map_delete_elem": (c_int, [c_int, c_void_p]),
        "bpf_map_get_next_key": (c_int, [c_int, c_void_p, c_void_p]),
        "bpf_map_update_batch": (c_int, [c_int, c_void_p, c_void_p, ctypes.POINTER(c_uint32), ctypes.POINTER(BatchOpts)]),
        "bpf_map_lookup_batch": (c_int, [c_int, c_void_p, c_void_p, c_void_p, c_void_p, ctypes.POINTER(c_uint32), ctypes.POINTER(BatchOpts)]),
        "bpf_map_delete_batch": (c_int, [c_int, c_void_p, ctypes.POINTER(c_uint32), ctypes.POINTER(BatchOpts)]),
        "bpf_obj_get_info_by_fd": (c_int, [c_int, c_void_p, ctypes.POINTER(c_uint32)]),
        "bpf_prog_test_run_opts": (c_int, [c_int, ctypes.POINTER(TestRunOpts)]),
        "bpf_map_create": (c_int, [c_uint32, c_char_p, c_uint32, c_uint32, c_uint32, c_void_p]),
        "bpf_map_get_fd_by_id": (c_int, [c_uint32]),
        "bpf_prog_attach": (c_int, [c_int, c_int, c_uint32, c_uint32]),
    }
    for fn, (res, args) in sig.items():
        f = getattr(so, fn)
        f.restype, f.argtypes = res, args
    return so


def check(ret: int, what: str) -> int:
    """libbpf returns -errno (and sets errno); raise OSError naming the operation."""
    if ret < 0:
        err = -ret if ret != -1 else (ctypes.get_errno() or errno.EINVAL)
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def obj_get(path: str) -> int:
    return check(lib().bpf_obj_get(path.encode()), f"open pinned object {path}")


def obj_pin(fd: int, path: str) -> None:
    check(lib().bpf_obj_pin(fd, path.encode()), f"pin at {path}")


BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_F_NO_PREALLOC = 1


class MapCreateOpts(ctypes.Structure):
    """libbpf's struct bpf_map_create_opts."""

    _fields_ = [("sz", c_size_t), ("btf_fd", c_uint32), ("btf_key_type_id", c_uint32),
                ("btf_value_type_id", c_uint32), ("btf_vmlinux_value_type_id", c_uint32),
                ("inner_map_fd", c_uint32), ("map_flags", c_uint32), ("map_extra", c_uint64),
                ("numa_node", c_uint32), ("map_ifindex", c_uint32)]


def map_create(map_type: int, name: str, key_size: int, value_size: int, max_entries: int, flags: int = 0,
               inner_map_fd: int = 0) -> int:
    opts = MapCreateOpts(sz=ctypes.sizeof(MapCreateOpts), map_flags=flags, inner_map_fd=inner_map_fd)
    return check(lib().bpf_map_create(map_type, name.encode(), key_size, value_size, max_entries,
                                      ctypes.byref(opts)), f"create map {name}")


def map_fd_by_id(map_id: int) -> int:
    return check(lib().bpf_map_get_fd_by_id(map_id), f"open map id {map_id}")


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    size = c_uint32(ctypes.sizeof(info))
    check(lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "map info")
    return info


def prog_info(fd: int) -> ProgInfo:
    info = ProgInfo()
    size = c_uint32(ctypes.sizeof(info))
    check(lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "program info")
    return info


def prog_instructions(fd: int) -> bytes:
    """The program's instructions as the kernel holds them after verification (8 bytes
    each; a 64-bit immediate load takes two), as `bpftool prog dump xlated` reads them."""
    n = prog_info(fd).xlated_prog_len
    buf = ctypes.create_string_buffer(n)
    info = ProgInfo(xlated_prog_len=n, xlated_prog_insns=ctypes.addressof(buf))
    size = c_uint32(ctypes.sizeof(info))
    check(lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "program instructions")
    if n and not info.xlated_prog_insns:
        raise OSError(errno.EPERM, "the kernel does not show this program's instructions (kernel.kptr_restrict)")
    return buf.raw[:min(n, info.xlated_prog_len)]


@lru_cache(maxsize=1)
def possible_cpus() -> int:
    """Number of possible CPUs: the stride of per-CPU map values."""
    text = open("/sys/devices/system/cpu/possible").read().strip()
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += (int(hi) if hi else int(lo)) - int(lo) + 1
    return count


def batch_opts(elem_flags: int = 0) -> BatchOpts:
    return BatchOpts(sz=ctypes.sizeof(BatchOpts), elem_flags=elem_flags, flags=0)


ENOTSUPP = 524  # the kernel's "operation not supported" for a map type without batch ops


def lookup_batches(fd: int, key_size: int, value_size: int, chunk: int = 4096, what: str = "map",
                   after: int | None = None):
    """Every entry of a map by batch lookups (one syscall per ``chunk`` entries), as
    (keys, values, count) packed bytes. ``after``: an array's entries from index after + 1
    on (the kernel's batch token is the last key read). OSError EINVAL or ENOTSUPP from the
    first call: the kernel has no batch lookup for this map type."""
    keys = ctypes.create_string_buffer(key_size * chunk)
    vals = ctypes.create_string_buffer(value_size * chunk)
    token_in, token_out = c_uint64(after or 0), c_uint64()
    opts, first = batch_opts(), after is None
    while True:
        count = c_uint32(chunk)
        ret = lib().bpf_map_lookup_batch(fd, None if first else ctypes.byref(token_in), ctypes.byref(token_out),
                                         keys, vals, ctypes.byref(count), ctypes.byref(opts))
        err = -ret if ret < 0 else 0
        if ret < 0 and err != errno.ENOENT:
            check(ret, f"batch lookup in {what}")
        if count.value:
            yield keys.raw[:count.value * key_size], vals.raw[:count.value * value_size], count.value
        if err == errno.ENOENT:
            return
        token_in.value, first = token_out.value, False


BPF_F_TEST_SKB_CHECKSUM_COMPLETE = 1 << 2
"""prog_test_run flag (Linux 6.12+): the skb arrives CHECKSUM_COMPLETE, as from a NIC that
sums every packet, and the run fails (EBADMSG) if the program left skb->csum wrong."""


def prog_test_run(prog_fd: int, data: bytes, repeat: int = 1, out_size: int = 0,
                  flags: int = 0) -> tuple[int, bytes, int]:
    """Run a program on ``data`` in the kernel (BPF_PROG_TEST_RUN).

    Returns (program return code, output frame, mean ns per run). With repeat > 1 the
    kernel runs the program on the same buffer each time, so from the second run on
    it sees its own output.
    """
    inbuf = ctypes.create_string_buffer(data, len(data))
    out_len = out_size or len(data) + 256
    outbuf = ctypes.create_string_buffer(out_len)
    opts = TestRunOpts(sz=ctypes.sizeof(TestRunOpts), data_in=ctypes.cast(inbuf, c_void_p),
                       data_out=ctypes.cast(outbuf, c_void_p), data_size_in=len(data),
                       data_size_out=out_len, repeat=repeat, flags=flags)
    check(lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return opts.retval, outbuf.raw[: opts.data_size_out], opts.duration
