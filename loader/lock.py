"""One writer at a time per pin directory.

Every command that writes a pin directory's maps or programs (`kxlb load`, `service add`,
`unload`, `cleanup`, the controller for its whole life) holds an exclusive ``flock`` on
the pin directory itself. The lock lives on the directory's bpffs inode, so a process in
a pod (the DaemonSet, with the host's bpffs mounted) and a shell on the host exclude each
other, and the kernel drops it when the holder dies, SIGKILL included: no stale lock
file to clean. Readers (list, conntrack, stats, status) take no lock; every write keeps
the maps consistent for packets at each step (bpf/maps.h), so a reader sees an older or
a newer service, never a broken one.

Who holds the lock comes from /proc/locks (the pid as this process's namespace sees it)
and from the holder's record in the registry (what it is: a controller for node X, a
`service add` ...), so a refusal names the holder.

A child process that the holder starts (the controller compiles in a short-lived child)
inherits the locked descriptor through ``KXLB_WRITER_LOCK_FD`` and shares the lock, as
flock shares it between descriptors of one open file.
"""
from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass

from .errors import KxlbError

ENV_FD = "KXLB_WRITER_LOCK_FD"
_HELD: dict[tuple[int, int], list[int]] = {}  # (dev, inode) -> [fd, holds]: re-entrant within a process


class LockBusy(KxlbError):
    """Another process holds the writer lock."""


@dataclass(frozen=True)
class Holder:
    pid: int | None          # as this process sees it; None: in a namespace we cannot see
    command: str              # its command line, or "" when unknown

    def __str__(self) -> str:
        if self.pid is None:
            return "a process in another PID namespace (a pod?)"
        return f"pid {self.pid}" + (f" ({self.command})" if self.command else "")


def _dev_ino(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def holders(path: str) -> list[Holder]:
    """Processes holding a flock on ``path`` (from /proc/locks)."""
    st = os.stat(path)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    try:
        lines = open("/proc/locks").read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" (a blocked waiter has "->" first)
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[2] == "->":
            continue
        if parts[5] != want:
            continue
        pid = int(parts[4])
        out.append(Holder(pid or None, _cmdline(pid) if pid else ""))
    return out


def _cmdline(pid: int) -> str:
    try:
        raw = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return ""
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    # `python -m kxlb.cli ...` or `.venv/bin/kxlb ...`: show from "kxlb" on
    for i, w in enumerate(words):
        if os.path.basename(w) == "kxlb" or w.startswith("kxlb."):
            return " ".join(["kxlb"] + words[i + 1:])[:200]
    return " ".join(words)[:200]


class WriterLock:
    """The exclusive writer lock of a pin directory (which must exist)."""

    def __init__(self, pin_dir: str):
        self.pin_dir = os.path.abspath(pin_dir)
        self.fd = -1
        self._what = ""
        self._extra: dict = {}

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def _inherited(self) -> int | None:
        """The descriptor a parent holding this lock passed on, if it is this directory's."""
        text = os.environ.get(ENV_FD, "")
        if not text.isdigit():
            return None
        fd = int(text)
        try:
            if _dev_ino(fd) == _dev_ino_path(self.pin_dir):
                return fd
        except OSError:
            pass
        return None

    def acquire(self, timeout: float = 0.0, poll: float = 0.05, what: str = "", patient: bool = False,
                **record) -> "WriterLock":
        """Take the lock, waiting up to ``timeout`` seconds (not at all when the holder is
        a long-lived writer, a controller holds it for its life, unless ``patient``: a
        new controller waits for the old one to go); LockBusy names the holder.
        ``what``: a long-lived writer's description ("the controller of node n1"),
        recorded with ``record`` (its health URL, say) for whoever finds the lock taken."""
        if self.held:
            return self
        mine = _HELD.get(_dev_ino_path(self.pin_dir))
        if mine is not None:  # this process holds it already (cleanup calls unload, ...)
            mine[1] += 1
            self.fd = mine[0]
            return self
        inherited = self._inherited()
        if inherited is not None:
            fcntl.flock(inherited, fcntl.LOCK_EX)  # shared with the parent: returns at once
            self.fd = inherited
            _HELD[_dev_ino(inherited)] = [inherited, 1]
            return self
        try:
            fd = os.open(self.pin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise KxlbError(f"cannot open pin directory {self.pin_dir}: {exc.strerror}") from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline or (not patient and _writer_doc(self.pin_dir).get("long_lived")):
                    os.close(fd)
                    raise LockBusy(self.busy_message()) from None
                time.sleep(poll)
        self.fd = fd
        self._what = what
        _HELD[_dev_ino(fd)] = [fd, 1]
        self._extra = record
        self._record(what, record)
        return self

    def announce(self) -> None:
        """Record the long-lived writer again (the registry did not exist at acquire)."""
        if self._what:
            self._record(self._what, self._extra)

    def _record(self, what: str, extra: dict | None = None) -> None:
        """Say who writes now; a short-lived writer clears what the previous one said."""
        from .registry import Registry

        try:
            with Registry(self.pin_dir) as reg:
                if reg.fd < 0:
                    return
                if what:
                    reg.put("writer", {"what": what, "pid": os.getpid(), "long_lived": True, **(extra or {}),
                                       "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                else:
                    reg.delete("writer")
        except (KxlbError, OSError):
            pass  # a directory of an older kxlb, or not ours: nothing to say there

    def busy_message(self) -> str:
        who = ", ".join(map(str, holders(self.pin_dir))) or "another process"
        doc = _writer_doc(self.pin_dir)
        if doc.get("long_lived"):
            return (f"{self.pin_dir} is written by {doc.get('what')} (since {doc.get('since')}; {who}): it owns "
                    f"the maps while it runs, so change Services through Kubernetes, or stop it first")
        return f"{self.pin_dir} is being written by {who}: one writer at a time (try again, or --wait SECONDS)"

    def release(self) -> None:
        if self.fd < 0:
            return
        held = _HELD.get(_dev_ino(self.fd))
        if held is not None:
            held[1] -= 1
            if held[1] > 0:  # an outer holder in this process keeps it
                self.fd = -1
                return
            del _HELD[_dev_ino(self.fd)]
        if self._what:
            self._record("")  # a long-lived writer that stops says so
        if self.fd != self._inherited():
            os.close(self.fd)  # closing the last descriptor of the open file drops the lock
        self.fd = -1

    def child_env(self) -> tuple[dict[str, str], tuple[int, ...]]:
        """Environment and pass_fds for a child process that works under this lock."""
        assert self.held
        os.set_inheritable(self.fd, True)
        return {**os.environ, ENV_FD: str(self.fd)}, (self.fd,)

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _writer_doc(pin_dir: str) -> dict:
    """The registry's record of the current long-lived writer ({} when none)."""
    from .registry import Registry

    try:
        with Registry(pin_dir) as reg:
            return reg.get("writer") or {}
    except (KxlbError, OSError, ValueError):
        return {}


def _dev_ino_path(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino
