"""Every header of bpf/ includes what it uses: each compiles on its own (with BCC, as
the datapath is built), so no header works only because of what kxlb.c included first."""
from __future__ import annotations

import pytest

from kxlb.loader.compile import BPF_DIR, compile_source

HEADERS = sorted(p.name for p in BPF_DIR.glob("*.h") if not p.name.endswith(".tmpl.h"))
TEMPLATES = sorted(p.name for p in BPF_DIR.glob("*.tmpl.h"))


def test_every_header_is_listed():
    assert {"maps.h", "ct.h", "nat.h", "nat6.h", "lb.h", "parse.h", "parse6.h", "reject.h", "reject6.h", "csum.h",
            "hash.h", "consts.h"} <= set(HEADERS)
    assert {"family.tmpl.h", "lb.tmpl.h", "ct.tmpl.h", "plan.tmpl.h", "flow.tmpl.h"} <= set(TEMPLATES)


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(header, tmp_path, pin_dirs):
    unit = tmp_path / f"only_{header}.c"
    unit.write_text(f'#define KXLB_DATAPATH 1\n#include <uapi/linux/bpf.h>\n#include "{BPF_DIR / header}"\n')
    compile_source(unit, pin_dirs(), ["-Werror=implicit-function-declaration"])


@pytest.mark.parametrize("family", ["4", "6"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_template_compiles_alone_for_each_family(template, family, tmp_path, pin_dirs):
    """A template needs only its family chosen; it includes what it builds on, and its
    per-family guard lets a second include of it (here, its own) add nothing."""
    unit = tmp_path / f"only_{template}_{family}.c"
    unit.write_text(f'#define KXLB_DATAPATH 1\n#include <uapi/linux/bpf.h>\n#define KX_FAM {family}\n'
                    f'#include "{BPF_DIR / template}"\n#include "{BPF_DIR / template}"\n')
    compile_source(unit, pin_dirs(), ["-Werror=implicit-function-declaration"])
