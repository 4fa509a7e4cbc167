"""Keeps the datapath attached to every interface of the node that matches the given
patterns, including interfaces that appear later (a pod's veth), as a DaemonSet would."""
from __future__ import annotations

import fnmatch
import logging
import threading

from kxlb.loader import attach
from kxlb.loader.compile import Datapath
from kxlb.loader.datapath import attach_one
from kxlb.loader.errors import KxlbError

log = logging.getLogger("kxlb.attacher")


class InterfaceAttacher:
    def __init__(self, dp: Datapath, ns: str | None, patterns: list[str], xdp_mode: str | None,
                 pin_dir: str, period: float = 0.2, xdp_trust_checksums: bool = False, registry=None):
        self.dp, self.ns, self.patterns, self.xdp_mode, self.pin_dir = dp, ns, patterns, xdp_mode, pin_dir
        self.period, self.xdp_trust_checksums = period, xdp_trust_checksums
        self.registry = registry  # the controller's (loader/registry.py): where attachments are recorded
        self.attached: set[str] = set()
        self.refused: dict[str, str] = {}  # interface -> why: logged once, retried quietly
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> list[str]:
        """Attach to matching interfaces not yet attached; returns the new ones."""
        names = [n for n in attach.list_links(self.ns) if any(fnmatch.fnmatch(n, p) for p in self.patterns)]
        self.attached &= set(names)  # forget interfaces that went away
        self.refused = {n: why for n, why in self.refused.items() if n in names}
        new = []
        for name in names:
            if name in self.attached:
                continue
            try:
                attach_one(self.dp, name, self.ns, self.xdp_mode, self.pin_dir,
                           xdp_trust_checksums=self.xdp_trust_checksums, reg=self.registry)
            except KxlbError as exc:  # it may vanish between listing and attaching, or be refused
                if self.refused.get(name) != str(exc):
                    log.warning("attaching to %s failed: %s", name, exc)
                    self.refused[name] = str(exc)
                continue
            self.refused.pop(name, None)
            self.attached.add(name)
            new.append(name)
            log.info("datapath attached to %s%s", name, f" in netns {self.ns}" if self.ns else "")
        return new

    def start(self) -> "InterfaceAttacher":
        self.scan()
        self._thread = threading.Thread(target=self._run, name="attacher", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.scan()
            except KxlbError as exc:
                log.error("interface scan failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
