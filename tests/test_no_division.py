"""No program of the datapath divides.

BPF has one divide instruction (and a modulo, its twin). clang emits it 64 bits wide (bcc
compiles without alu32), and the x86 JIT turns it into a 64-bit `div`, tens of cycles on
most cores. A new flow took two (its Maglev entry, `hash % M`, then the entry's chunk,
`/ 480`) and a masquerade port search one per port tried. They are multiplies and shifts
now (bpf/hash.h kx_range, bpf/lb.h lb_maglev_chunk): this test reads every program back
from the kernel, as it runs it, and fails on any divide or modulo instruction, so the next
`%` in the datapath is a choice, made here. It fails on the build before that change
(ten in each packet program).
"""
from __future__ import annotations

from kxlb.loader import bpfsys

PACKET_PROGRAMS = ("kxlb_tc", "kxlb_xdp", "kxlb_tc6", "kxlb_xdp6", "kxlb_tc_egress")

BPF_ALU, BPF_ALU64 = 0x04, 0x07      # instruction classes (opcode & 7)
BPF_DIV, BPF_MOD = 0x30, 0x90        # operations (opcode & 0xf0) of the two ALU classes
BPF_LD_IMM64 = 0x18                  # the one instruction that takes 16 bytes


def divisions(insns: bytes) -> list[int]:
    """Indexes of the divide and modulo instructions (either width) in a program."""
    found, i = [], 0
    while i < len(insns):
        op = insns[i]
        if op & 0x07 in (BPF_ALU, BPF_ALU64) and op & 0xf0 in (BPF_DIV, BPF_MOD):
            found.append(i // 8)
        i += 16 if op == BPF_LD_IMM64 else 8
    return found


def test_the_decoder_finds_a_division():
    """The check itself: `r2 /= r1` and `w1 %= 7` are found, an immediate load whose
    second half looks like a divide is not, nor are other ALU operations."""
    div64_reg = bytes([0x3f, 0x12, 0, 0, 0, 0, 0, 0])
    mod32_imm = bytes([0x94, 0x01, 0, 0, 7, 0, 0, 0])
    ld_imm64 = bytes([0x18, 0x01, 0, 0, 1, 0, 0, 0, 0x3f, 0, 0, 0, 0, 0, 0, 0])
    add64 = bytes([0x0f, 0x12, 0, 0, 0, 0, 0, 0])
    exit_ = bytes([0x95, 0, 0, 0, 0, 0, 0, 0])
    assert divisions(add64 + div64_reg + ld_imm64 + mod32_imm + exit_) == [1, 4]
    assert divisions(ld_imm64 + add64 + exit_) == []


def test_no_program_divides(dp):
    from kxlb.loader.socklb import compile_sock

    datapath, maps = dp
    fds = {name: datapath.bpf.funcs[name.encode()].fd for name in PACKET_PROGRAMS}
    fds.update(compile_sock(maps.pin_dir))  # the socket hooks: lb_decide and their own slot search
    insns = {name: bpfsys.prog_instructions(fd) for name, fd in fds.items()}
    assert all(len(code) >= 8 for code in insns.values()), {n: len(c) for n, c in insns.items()}
    found = {name: divisions(code) for name, code in insns.items()}
    print("divide instructions:", {name: len(at) for name, at in found.items()})
    assert not any(found.values()), (
        f"programs that divide, at these instructions: { {n: at for n, at in found.items() if at} }; "
        "see docs/datapath.md, *No division*")
