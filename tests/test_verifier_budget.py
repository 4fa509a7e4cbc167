"""Every program of the datapath verifies well inside the kernel's limit.

A kernel's verifier walks each path of a program that it cannot prune, and refuses the
program (E2BIG) once it has walked 1,000,000 instructions. How much it prunes differs
between kernels: Debian 12's 6.1 refuses kxlb_tc outright (docs/vagrant.md). A program
near the limit on this kernel is over it on another one, or after the next small change,
and then kxlb does not load at all. kxlb_tc took 936,000 here before its scratch moved
off the stack (bpf/flow.tmpl.h, struct lb_scratch); this test fails on that code.
"""
from __future__ import annotations

from kxlb.loader import bpfsys

BUDGET = 0.75
"""Of the limit: a quarter is left for kernels that prune less, and for what comes next."""

PROGRAMS = ("kxlb_tc", "kxlb_xdp", "kxlb_tc6", "kxlb_xdp6", "kxlb_tc_egress")


def test_each_program_verifies_within_three_quarters_of_the_limit(dp):
    datapath, _ = dp
    infos = {name: bpfsys.prog_info(datapath.bpf.funcs[name.encode()].fd) for name in PROGRAMS}
    walked = {name: info.verified_insns for name, info in infos.items()}
    print("instructions the verifier walked:", walked)
    assert all(n > 0 for n in walked.values()), f"this kernel reports no verifier counts (Linux >= 5.16): {walked}"
    # The verifier walks each instruction the program kept at least once: a ProgInfo
    # mirror that read the wrong field would not hold to this.
    kept = {name: info.xlated_prog_len // 8 for name, info in infos.items()}
    assert all(0 < kept[name] <= walked[name] for name in PROGRAMS), (kept, walked)
    limit = int(BUDGET * bpfsys.VERIFIER_INSN_LIMIT)
    over = {name: n for name, n in walked.items() if n > limit}
    assert not over, (f"programs the verifier walked more than {limit:,} instructions of for "
                      f"({BUDGET:.0%} of its limit): {over}; see docs/datapath.md, *Verifier budget*")
