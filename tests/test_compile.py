"""What a failed compile of the datapath tells its user."""
from __future__ import annotations

import subprocess
import sys

# A program whose stack cannot fit the BPF limit: LLVM reports it as a fatal error and
# ends the process (exit(1)) from inside the compile, while kxlb captures fd 2.
TOO_BIG = r"""
#include <uapi/linux/bpf.h>
int too_big(struct __sk_buff *skb)
{
	volatile char buf[600];
	buf[skb->len & 511] = 1;
	return buf[skb->mark & 511];
}
"""

RUN = r"""
import sys
from pathlib import Path
from kxlb.loader.compile import compile_source
compile_source(Path(sys.argv[1]), sys.argv[2])
print("compiled")
"""


def test_a_fatal_compiler_error_is_shown_though_it_ends_the_process(tmp_path, pin_dirs):
    unit = tmp_path / "too_big.c"
    unit.write_text(TOO_BIG)
    r = subprocess.run([sys.executable, "-c", RUN, str(unit), pin_dirs()], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "compiled" not in r.stdout
    assert "the compiler ended the process" in r.stderr
    assert "stack limit" in r.stderr, r.stderr[-2000:]
