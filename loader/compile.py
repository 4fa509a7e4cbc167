"""Compile the datapath with BCC.

BCC rewrites map operations (``ct_map.lookup(&k)``) only in the main source file, not
in headers it includes, so the local headers of ``bpf/`` are inlined into one text
before compiling. ``#line`` markers keep compiler messages pointing at the real files.

Templates (``*.tmpl.h``, bpf/family.tmpl.h) are written once for both address
families and inlined at every include, with ``KX_(name)`` spelled for the family the
including file last chose with ``#define KX_FAM 4`` or ``6``: ``name`` for IPv4,
``name6`` for IPv6, include lines too (``#include "KX_(nat).h"``: nat.h or nat6.h).
The substitution is textual, here, because BCC refuses a map call that a macro expands
to. A template guards itself per family (``#ifndef KX_(KXLB_X_TMPL_H)``), so any file
may include the templates it builds on.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import bpfsys
from .errors import KxlbError
from .layout import BPF_DIR, C
from .sctp import fill_crc_shift

MAIN_SOURCE = BPF_DIR / "kxlb.c"
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_FAMILY = re.compile(r'^\s*#\s*define\s+KX_FAM\s+(\d+)\s*$')
_FAMILY_NAME = re.compile(r"\bKX_\((\w+)\)")
TEMPLATE_SUFFIX = ".tmpl.h"
FAMILY_SUFFIX = {"4": "", "6": "6"}


def instantiate(text: str, family: str | None, where: Path) -> str:
    """A template's text for one address family: ``KX_(name)`` -> ``name`` (IPv4) or
    ``name6`` (IPv6)."""
    if family not in FAMILY_SUFFIX:
        raise KxlbError(f"{where}: a template included before `#define KX_FAM 4` or `6`")
    return _FAMILY_NAME.sub(lambda m: m.group(1) + FAMILY_SUFFIX[family], text)


def inline_source(path: Path = MAIN_SOURCE, _seen: set[Path] | None = None,
                  _family: list[str | None] | None = None) -> str:
    """Return ``path`` with its local ``#include "x.h"`` lines replaced by the files:
    each header once (they have include guards), each template at every include, for
    the address family chosen last (see the module's docstring)."""
    seen = _seen if _seen is not None else set()
    family = _family if _family is not None else [None]
    is_template = path.name.endswith(TEMPLATE_SUFFIX)
    out: list[str] = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        fam = _FAMILY.match(line)
        if fam:
            family[0] = fam.group(1)
        if is_template:
            line = instantiate(line, family[0], path)
        m = _LOCAL_INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        inc = (path.parent / m.group(1)).resolve()
        if inc.name.endswith(TEMPLATE_SUFFIX) or inc not in seen:
            seen.add(inc)
            out.append(inline_source(inc, seen, family))
        out.append(f'#line {lineno + 1} "{path}"')
    return "\n".join(out) + "\n"


def c_string(text: str) -> str:
    """``text`` as a C string literal (the pin directory goes into the source as one)."""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7f for ch in text):
        raise KxlbError(f"pin directory {text!r} has control characters")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build_digest(extra_cflags: list[str] | None = None) -> str:
    """What a compile's output depends on: the datapath's C (inlined, both programs), the
    build flags, the BCC release and the running kernel. Equal digests mean the pinned
    programs are what a compile would load now, so a restart can attach them as they are."""
    import hashlib

    h = hashlib.sha256()
    for src in (MAIN_SOURCE, BPF_DIR / "sock.c"):
        h.update(inline_source(src).encode())
    h.update(repr(sorted(extra_cflags or [])).encode())
    uname = os.uname()
    h.update(f"{uname.release} {uname.version}".encode())
    bcc_version = Path("/usr/lib/python3/dist-packages/bcc/version.py")
    h.update(bcc_version.read_bytes() if bcc_version.exists() else b"?")
    return h.hexdigest()[:32]


# Holds what clang writes while BCC compiles. LLVM ends the process on a fatal error
# (exit(1), e.g. "BPF stack limit exceeded") while fd 2 is captured: this process, not
# the compiling one, then finds nobody took the lines and shows them on the real stderr.
_WATCHER = r"""
import os, sys
data = sys.stdin.buffer.read()
with open(sys.argv[1], "wb") as out:
    out.write(data)
if not os.path.exists(sys.argv[1] + ".taken"):
    sys.stderr.buffer.write(b"kxlb: the compiler ended the process:\n" + data)
"""


@contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Collect the lines C code (clang inside BCC) writes to file descriptor 2. A child
    process holds them (_WATCHER), so a fatal LLVM error that exits this process is not
    lost with it."""
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kxlb-cc-") as tmp:
        where = os.path.join(tmp, "stderr")
        r, w = os.pipe()
        watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, where], stdin=r, close_fds=True)
        os.close(r)
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(w, 2)
        os.close(w)
        try:
            yield lines
        finally:
            open(where + ".taken", "w").close()
            os.dup2(saved, 2)
            os.close(saved)
            watcher.wait()
            with open(where, errors="replace") as got:
                lines.extend(got.read().splitlines())


@dataclass(frozen=True)
class Datapath:
    """The datapath's two programs: file descriptors to attach (and the BCC module that
    made them, when compiled in this process)."""

    bpf: object | None  # bcc.BPF; kept alive so the program fds stay open
    tc_fd: int
    xdp_fd: int
    tc_egress_fd: int   # ICMP errors the node generates about translated flows


PROG_PINS = {"tc": "prog_tc", "xdp": "prog_xdp", "tc_egress": "prog_tc_egress"}  # pinned beside the maps


def pinned_datapath(pin_dir: str) -> Datapath:
    """The programs pinned by an earlier compile: attachable without BCC, so a
    long-running process (the controller) never loads LLVM."""
    try:
        fds = {hook: bpfsys.obj_get(os.path.join(pin_dir, name)) for hook, name in PROG_PINS.items()}
    except OSError as exc:
        raise KxlbError(f"no datapath programs pinned in {pin_dir}: {exc.strerror}") from None
    return Datapath(bpf=None, tc_fd=fds["tc"], xdp_fd=fds["xdp"], tc_egress_fd=fds["tc_egress"])


def compile_source(source: Path, pin_dir: str, extra_cflags: list[str] | None = None):
    """Compile one program file with BCC; its maps are created at (or reused from)
    ``pin_dir`` in bpffs. Returns the bcc.BPF module."""
    from bcc import BPF  # imported late: bcc is a system module, needed only here

    text = inline_source(source)
    cflags = [f"-DKXLB_PIN_DIR={c_string(pin_dir)}", "-Wno-unused-function"] + (extra_cflags or [])
    os.makedirs(pin_dir, exist_ok=True)
    with _captured_stderr() as diagnostics:
        try:
            return BPF(text=text.encode(), cflags=cflags)
        except Exception as exc:  # bcc raises a bare Exception; clang wrote to fd 2
            failed = exc
    errors = [line for line in diagnostics if "error:" in line]
    raise KxlbError(f"compiling {source} failed: {'; '.join(errors[:3]) or failed}") from None


def load_entry_programs(bpf) -> tuple:
    """Load kxlb_tc and kxlb_xdp of a compiled kxlb.c, and the IPv6 journeys they
    tail-call into their program arrays (kxlb.c); returns (tc, xdp) as bcc functions."""
    from bcc import BPF

    fill_crc_shift(bpf)
    try:
        tc = bpf.load_func(b"kxlb_tc", BPF.SCHED_CLS)
        xdp = bpf.load_func(b"kxlb_xdp", BPF.XDP)
        family = {("tc_progs", "PROG_IPV6"): bpf.load_func(b"kxlb_tc6", BPF.SCHED_CLS),
                  ("xdp_progs", "PROG_IPV6"): bpf.load_func(b"kxlb_xdp6", BPF.XDP)}
    except Exception as exc:
        raise KxlbError(f"the kernel rejected the datapath: {exc}") from exc
    for (array, slot), fn in family.items():
        bpf.get_table(array.encode())[ctypes.c_int(C[slot])] = ctypes.c_int(fn.fd)
    return tc, xdp


def compile_datapath(pin_dir: str, extra_cflags: list[str] | None = None) -> Datapath:
    """Compile and load the tc and XDP programs (maps pinned in ``pin_dir``)."""
    from bcc import BPF

    bpf = compile_source(MAIN_SOURCE, pin_dir, extra_cflags)
    tc, xdp = load_entry_programs(bpf)
    try:
        egress = bpf.load_func(b"kxlb_tc_egress", BPF.SCHED_CLS)
    except Exception as exc:
        raise KxlbError(f"the kernel rejected the datapath: {exc}") from exc
    for hook, fd in (("tc", tc.fd), ("xdp", xdp.fd), ("tc_egress", egress.fd)):
        path = os.path.join(pin_dir, PROG_PINS[hook])
        if os.path.exists(path):
            os.unlink(path)  # the new program replaces the pin (attachments keep theirs)
        bpfsys.obj_pin(fd, path)
    return Datapath(bpf=bpf, tc_fd=tc.fd, xdp_fd=xdp.fd, tc_egress_fd=egress.fd)
