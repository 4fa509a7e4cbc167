"""Process supervision for the lab's long-running processes: the control plane's
components (``lab/controlplane.py``), and the nodes' daemons, relays and proxies
(``lab/cluster.py``).

A process is started in a session (process group) of its own, with an environment
marker (``<marker_env>=<workdir>``), its output in ``logs/<name>.log`` and a pidfile
``run/<prefix><role>.pid`` (JSON: pid, process start time, argv, log). The pidfile
lets another Python process (``kxlb lab down`` after a crash) find it, the start time
keeps a recycled pid from being mistaken for it, and the marker finds whatever the
pidfiles lost (a crash between fork and pidfile, a child it forked).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from . import pki, procs

# Environment variables never passed on: nothing of ours should talk through a proxy.
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
              "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
# The markers: the lab's own processes (lab/cluster.py) and the control plane's.
LAB_MARKER = "KXLB_LAB"
CONTROLPLANE_MARKER = "KXLB_CONTROLPLANE"
# A child gets its own marker, never its parent's.
MARKERS = (LAB_MARKER, CONTROLPLANE_MARKER)


def clean_env(marker_env: str, marker: str, extra: Optional[dict] = None) -> dict:
    """This process's environment for a child: without proxies, KUBECONFIG or another
    lab marker, with ``marker_env=marker`` and *extra*."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS and k != "KUBECONFIG" and k not in MARKERS}
    env[marker_env] = marker
    env.update(extra or {})
    return env


class Supervisor:
    """The processes of one work directory under one marker (see the module's doc)."""

    def __init__(self, workdir: Path, marker_env: str, *, error: type[Exception], prefix: str = "",
                 fresh_logs: bool = False, log: Callable[[str], None] = lambda _: None):
        self.workdir = Path(workdir)
        self.marker_env = marker_env
        self.marker = str(self.workdir)
        self.prefix = prefix            # pidfile names: run/<prefix><role>.pid
        self.fresh_logs = fresh_logs    # a new log per start (else appended to)
        self.log = log
        self.error = error              # raised for processes that survive SIGKILL
        self.children: dict[str, subprocess.Popen] = {}  # started by this process

    def pidfile(self, role: str) -> Path:
        return self.workdir / "run" / f"{self.prefix}{role}.pid"

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def roles(self) -> list[str]:
        """Every role with a pidfile (running or not)."""
        return sorted(p.stem.removeprefix(self.prefix) for p in (self.workdir / "run").glob(f"{self.prefix}*.pid"))

    def read(self, role: str) -> Optional[dict]:
        """The pidfile of *role* if its process still runs (same pid, same start time)."""
        try:
            info = json.loads(self.pidfile(role).read_text())
            return info if procs.alive(int(info["pid"]), info.get("start")) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def env(self, extra: Optional[dict] = None) -> dict:
        return clean_env(self.marker_env, self.marker, extra)

    def spawn(self, role: str, argv: list[str], log_name: Optional[str] = None, *, cgroup: Optional[str] = None,
              extra_env: Optional[dict] = None) -> subprocess.Popen:
        """Start *argv* as *role* (in *cgroup*, a directory of cgroup.procs, if given).
        Raises OSError when it cannot be started."""
        logp = self.log_path(log_name or role)
        logp.parent.mkdir(parents=True, exist_ok=True)

        def preexec() -> None:
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write("0")

        with open(logp, "wb" if self.fresh_logs else "ab") as logf:
            logf.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {' '.join(argv)}\n".encode())
            logf.flush()
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 cwd=self.workdir, env=self.env(extra_env), start_new_session=True,
                                 close_fds=True, preexec_fn=preexec if cgroup else None)
        self.children[role] = p
        st = procs.proc_stat(p.pid)
        info = {"pid": p.pid, "start": st[1] if st else None, "argv": argv, "log": str(logp)}
        pki.write_public(self.pidfile(role), (json.dumps(info) + "\n").encode())
        return p

    def exit_code(self, role: str) -> Optional[int]:
        """The exit code of *role* if this process started it and it has exited."""
        p = self.children.get(role)
        return p.poll() if p is not None else None

    def reap(self) -> None:
        """Collect the children that exited (no zombies while we wait for them)."""
        for role, p in list(self.children.items()):
            if p.poll() is not None:
                del self.children[role]

    def marked(self) -> list[int]:
        """Every live process carrying this supervisor's marker."""
        return procs.marked_pids(self.marker_env, self.marker)

    def stop(self, group: procs.Group, grace: float) -> None:
        """SIGTERM to each process group, SIGKILL after *grace*; raises ``error`` naming
        the pids that survive even that."""
        left = procs.stop(group, grace, log=self.log, poll=self.reap)
        if left:
            raise self.error(f"processes {left} of {self.workdir} survive SIGKILL")

    def stop_roles(self, roles: Iterable[str], grace: float) -> None:
        """Stop these roles' processes and remove their pidfiles."""
        group: procs.Group = {}
        for role in roles:
            info = self.read(role)
            if info:
                group[int(info["pid"])] = info.get("start")
            self.pidfile(role).unlink(missing_ok=True)
        self.stop(group, grace)
