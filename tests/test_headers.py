"""Every header of bpf/ includes what it uses: each compiles on its own (with BCC, as
the datapath is built), so no header works only because of what kxlb.c included first."""
from __future__ import annotations

import pytest

from kxlb.loader.compile import BPF_DIR, compile_source

HEADERS = sorted(p.name for p in BPF_DIR.glob("*.h"))


def test_every_header_is_listed():
    assert {"maps.h", "ct.h", "nat.h", "lb.h", "parse.h", "reject.h", "csum.h", "hash.h", "consts.h"} <= set(HEADERS)


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(header, tmp_path, pin_dirs):
    unit = tmp_path / f"only_{header}.c"
    unit.write_text(f'#define KXLB_DATAPATH 1\n#include <uapi/linux/bpf.h>\n#include "{BPF_DIR / header}"\n')
    compile_source(unit, pin_dirs(), ["-Werror=implicit-function-declaration"])
