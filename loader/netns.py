"""Entering network namespaces from Python.

setns(2) moves only the calling thread, and a socket keeps the namespace it was created
in: so a netlink socket opened inside the context below keeps working in that
namespace after we return to ours, and file descriptors (BPF programs) stay valid
because they belong to the process.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterator

from .errors import KxlbError

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/var/run/netns"
_libc = ctypes.CDLL(None, use_errno=True)


def netns_path(spec: str | None) -> str | None:
    """Name (as `ip netns` knows it) or a path such as /proc/PID/ns/net -> path."""
    if not spec:
        return None
    path = spec if "/" in spec else os.path.join(NETNS_RUN_DIR, spec)
    if not os.path.exists(path):
        raise KxlbError(f"network namespace {spec!r} not found ({path} does not exist)")
    return path


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise KxlbError(f"cannot enter network namespace {what}: {os.strerror(err)}"
                        + (" (needs root)" if err == 1 else ""))


@contextmanager
def netns(spec: str | None) -> Iterator[None]:
    """Run the body inside network namespace ``spec`` (None: stay where we are)."""
    path = netns_path(spec)
    if path is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path, os.O_RDONLY)
    except OSError as exc:
        os.close(home)
        raise KxlbError(f"cannot open network namespace {spec!r}: {exc.strerror}") from None
    try:
        _setns(target, repr(spec))
        try:
            yield
        finally:
            _setns(home, "of origin")
    finally:
        os.close(target)
        os.close(home)
