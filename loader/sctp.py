"""The constant the datapath's SCTP port translation needs (bpf/sctp.h): x^(8n) mod P of
CRC32c for every SCTP packet length n, in the bit-reflected form, written into the
datapath's ``sctp_crc_shift`` array before its programs are loaded.

A port change D (zero outside an SCTP packet's first four bytes d) changes the packet's
CRC by d * x^(8n) mod P; the datapath reads x^(8n) here and multiplies (32 shifts and XORs)
instead of raising x to the power itself on every verified path.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from .layout import C

POLY = 0x82F63B78        # CRC32c (Castagnoli), bit-reflected
ONE = 1 << 31            # x^0, bit-reflected


def mulmod(a: int, b: int) -> int:
    """a * b mod P, bit-reflected (bpf/sctp.h crc32c_mulmod; zlib's multmodp)."""
    p = 0
    for i in range(32):
        if a >> (31 - i) & 1:
            p ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)
    return p


@lru_cache(maxsize=1)
def crc_shift_table() -> tuple[int, ...]:
    """x^(8n) mod P for n = 0 .. KXLB_SCTP_LENGTHS - 1: each entry is the one before it
    times x^8, which is eight steps of the CRC register over a zero byte."""
    out, v = [], ONE
    for _ in range(C["SCTP_LENGTHS"]):
        out.append(v)
        for _ in range(8):
            v = (v >> 1) ^ (POLY if v & 1 else 0)
    return tuple(out)


def fill_crc_shift(bpf) -> None:
    """Write the table into a compiled kxlb.c's ``sctp_crc_shift`` (before its programs
    load, so that none ever reads it empty)."""
    table = bpf.get_table(b"sctp_crc_shift")
    n = C["SCTP_LENGTHS"]
    keys = (ctypes.c_uint32 * n)(*range(n))
    values = (ctypes.c_uint32 * n)(*crc_shift_table())
    try:
        table.items_update_batch(keys, values)
    except Exception:  # a kernel without batch operations: one by one
        for k, v in zip(keys, values):
            table[ctypes.c_uint32(k)] = ctypes.c_uint32(v)
