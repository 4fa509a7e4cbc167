"""The maps' structs for Python, made from their one declaration: bpf/maps.h.

Every `struct name { ... };` of maps.h becomes a ctypes Structure with the same fields,
in the same order, with C's alignment (ctypes lays fields out as the C compiler does for
these types). Network-order fields (__be16, __be32) are plain unsigned integers holding
the raw wire bytes; array lengths may be KXLB_ constants of consts.h. tests/test_layout.py
still checks every struct, field by field, against the BTF clang emits for maps.h: the
parser here and the compiler must agree.

Why generated: hand-written mirrors beside the C were two declarations of one layout, to
be changed together by hand (and a test to notice when they were not).
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

SCALARS = {"__u8": ctypes.c_uint8, "__u16": ctypes.c_uint16, "__u32": ctypes.c_uint32, "__u64": ctypes.c_uint64,
           "__be16": ctypes.c_uint16, "__be32": ctypes.c_uint32, "__s32": ctypes.c_int32, "__s64": ctypes.c_int64}

_STRUCT = re.compile(r"^struct\s+(\w+)\s*\{(.*?)^\};", re.S | re.M)
_FIELD = re.compile(r"^\s*(struct\s+\w+|\w+)\s+(\w+)\s*(?:\[\s*(\w+)\s*\])?\s*;")


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text, flags=re.S), flags=re.S)


def parse(path: Path, consts: dict[str, int]) -> dict[str, type[ctypes.Structure]]:
    """struct name -> ctypes class, for every struct declared in ``path``, in order (a
    struct may use those declared before it)."""
    out: dict[str, type[ctypes.Structure]] = {}
    text = _strip_comments(path.read_text())
    for m in _STRUCT.finditer(text):
        name, body = m.group(1), m.group(2)
        fields = []
        for line in body.splitlines():
            if not line.strip():
                continue
            f = _FIELD.match(line)
            if not f:
                raise ValueError(f"{path}: struct {name}: cannot read the field {line.strip()!r}")
            ctype, fname, count = f.groups()
            if ctype.startswith("struct "):
                t = out[ctype.split()[1]]
            else:
                t = SCALARS[ctype]
            if count:
                n = int(count) if count.isdigit() else consts[count.removeprefix("KXLB_")]
                t = t * n
            fields.append((fname, t))
        out[name] = type(_class_name(name), (ctypes.Structure,), {"_fields_": fields, "__doc__": f"struct {name}"})
    return out


def _class_name(c_name: str) -> str:
    return "".join(part.capitalize() for part in c_name.split("_"))
