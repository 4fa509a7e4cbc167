"""Process supervision for the lab: what runs (from /proc), which processes belong to a
workdir (an environment marker every process the lab starts inherits), and stopping
them with their whole process group.

The control plane (controlplane.py) and the nodes' daemons (cluster.py: pod agents,
proxies, the LB pool) share it, so a process is found and stopped the same way whoever
started it. Pure /proc and signals: no lab state."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

Group = dict[int, Optional[int]]   # pid -> its start time (clock ticks; None: whichever process has the pid)


def proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks) of *pid*, or None if it does not exist."""
    fields = _stat_fields(pid)
    return (fields[0].decode(), int(fields[19])) if fields else None


def _stat_fields(pid: int | str) -> Optional[list[bytes]]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def alive(pid: int, start: Optional[int] = None) -> bool:
    """True if *pid* runs and (given *start*) is the process that started then.
    Zombies count as dead, and are reaped here when they are our children."""
    st = proc_stat(pid)
    if st is None or (start is not None and st[1] != start):
        return False
    if st[0] in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:
            pass
        return False
    return True


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time the live ones of *pids* have used (threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def group_members(pgid: int) -> list[int]:
    """Live processes of process group *pgid* (the leader may be gone: its children stay)."""
    out = []
    for name in os.listdir("/proc"):
        fields = _stat_fields(name) if name.isdigit() else None
        if fields and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(name))
    return sorted(out)


def marked(key: str) -> dict[int, str]:
    """Every live process (but this one) whose environment sets *key*: pid -> its value."""
    prefix = f"{key}=".encode()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(prefix) and alive(int(name)):
                out[int(name)] = var[len(prefix):].decode(errors="replace")
    return out


def marked_pids(key: str, value: str) -> list[int]:
    """Live processes whose environment holds ``key=value``."""
    return sorted(p for p, v in marked(key).items() if v == value)


def exe_name(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return "?"


def tail(path: os.PathLike | str, lines: int = 25) -> str:
    """The last lines of a log, for an error message."""
    try:
        data = Path(path).read_bytes()[-16384:].decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


def _pgid(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def stop(group: Group, grace: float, *, log: Callable[[str], None] = lambda _: None,
         poll: Callable[[], None] = lambda: None) -> list[int]:
    """Stop *group*: SIGTERM (to the process group of each leader among them, so what it
    forked goes too, else to the process), SIGKILL after *grace* seconds, then whatever
    is left of the leaders' process groups. *poll* runs while waiting (to reap our own
    children). Returns the pids that survive SIGKILL (empty: all stopped)."""
    def send(sig: int) -> None:
        for pid, start in group.items():
            if not alive(pid, start):
                continue
            try:
                if _pgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(pids: Callable[[], list[int]], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            poll()
            left = pids()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    if not group:
        return []
    leaders = [pid for pid, start in group.items() if alive(pid, start) and _pgid(pid) == pid]
    send(signal.SIGTERM)

    def running() -> list[int]:
        return [p for p, s in group.items() if alive(p, s)]

    left = wait(running, grace)
    if left:
        log(f"pids {left} ignored SIGTERM for {grace:.0f}s; SIGKILL")
        send(signal.SIGKILL)
        left = wait(running, 10)
        if left:
            return left

    # What a leader forked may outlive it: kube-proxy's iptables-restore, minutes into a
    # large ruleset, would hold the xtables lock against the next proxy's clean-up.
    def stragglers() -> list[int]:
        rest = [p for pgid in leaders for p in group_members(pgid)]
        for pgid in leaders:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return rest

    return wait(stragglers, 10)
