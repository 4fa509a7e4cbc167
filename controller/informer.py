"""List + watch of one resource, with raw JSON and the recovery rules of a robust watch.

- List with `_preload_content=False` and parse the JSON ourselves (no model objects).
- Watch from the list's resourceVersion with bookmarks, a server-side timeout and a
  client read timeout longer than it, so a silently dead connection cannot hang us.
- Every event, BOOKMARK included, advances the resourceVersion.
- 410 Gone (ERROR event or HTTP status): relist and emit the difference against the
  cache as adds/updates/deletes. The cache is never cleared to start over, so the
  datapath is never flushed.
- Other errors: jittered exponential backoff, then watch again from the last version.
"""
from __future__ import annotations

import json
import logging
import random
import socket
import threading
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("kxlb.informer")

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
Handler = Callable[[str, str, dict], None]  # (event type, "ns/name", object)


class Gone(Exception):
    """The resourceVersion is too old (HTTP 410): relist."""


@dataclass
class WatchTiming:
    server_timeout_s: int = 240      # the API server ends each watch after this
    read_timeout_s: float = 270      # our socket read timeout: longer than the server's
    connect_timeout_s: float = 5
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10


def object_key(obj: dict) -> str:
    md = obj.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


def _lines(resp):
    """Yield complete lines of a streamed HTTP body."""
    buf = b""
    for chunk in resp.stream(65536, decode_content=True):
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1:]
            if line.strip():
                yield line
    if buf.strip():
        yield buf


class Informer:
    """Keeps ``store`` equal to the server's view of one resource and calls ``handler``
    for every change. ``list_fn`` is a kubernetes-client list function (e.g.
    CoreV1Api.list_service_for_all_namespaces); ``kwargs`` its selectors."""

    def __init__(self, name: str, list_fn: Callable, handler: Handler, kwargs: dict | None = None,
                 timing: WatchTiming | None = None, on_restart: Callable[[str, str], None] | None = None):
        self.name, self.list_fn, self.handler = name, list_fn, handler
        self.kwargs = kwargs or {}
        self.timing = timing or WatchTiming()
        self.on_restart = on_restart or (lambda resource, reason: None)
        # key -> resourceVersion: all a relist needs to tell what changed (the decoded
        # objects live in the handler's caches; raw JSON is not kept twice)
        self.store: dict[str, str] = {}
        self.resource_version: str | None = None
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._resp = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Informer":
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            try:  # wakes the reader; close() would wait for the TLS lock the reader holds
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread:
            self._thread.join(timeout=1)  # a read blocked in the socket ends with the process

    def _run(self) -> None:
        backoff = self.timing.backoff_initial_s
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self.relist()
                self._watch()
                backoff = self.timing.backoff_initial_s  # a watch ended normally
            except Gone:
                log.info("%s: resourceVersion %s is gone (410): relisting", self.name, self.resource_version)
                self.on_restart(self.name, "gone")
                self.resource_version = None
            except Exception as exc:  # connection refused, reset, read timeout, 5xx ...
                if self._stop.is_set():
                    return
                reason = _reason(exc)
                self.on_restart(self.name, reason)
                delay = backoff * (0.5 + random.random())  # jitter: 50%..150%
                log.warning("%s: watch failed (%s: %s); retrying in %.2fs", self.name, reason, exc, delay)
                self._stop.wait(delay)
                backoff = min(backoff * 2, self.timing.backoff_max_s)

    # --- list ----------------------------------------------------------------------------------
    def relist(self) -> None:
        """List, then emit the difference against the cache (which is kept, not cleared)."""
        t = self.timing
        resp = self.list_fn(**self.kwargs, _preload_content=False,
                            _request_timeout=(t.connect_timeout_s, t.read_timeout_s))
        try:
            data = json.loads(resp.data)
        finally:
            resp.release_conn()
        fresh = {object_key(o): o for o in data.get("items") or []}
        for key in [k for k in self.store if k not in fresh]:
            del self.store[key]
            ns, _, name = key.partition("/")
            self.handler(DELETED, key, {"metadata": {"namespace": ns, "name": name}})
        for key, obj in fresh.items():
            old_rv, rv = self.store.get(key), obj["metadata"].get("resourceVersion")
            self.store[key] = rv
            if old_rv is None:
                self.handler(ADDED, key, obj)
            elif old_rv != rv:
                self.handler(MODIFIED, key, obj)
        self.resource_version = data["metadata"]["resourceVersion"]
        self.synced.set()
        log.info("%s: listed %d objects at resourceVersion %s", self.name, len(fresh), self.resource_version)

    # --- watch ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        t = self.timing
        try:
            resp = self.list_fn(**self.kwargs, watch=True, resource_version=self.resource_version,
                                allow_watch_bookmarks=True, timeout_seconds=t.server_timeout_s,
                                _preload_content=False, _request_timeout=(t.connect_timeout_s, t.read_timeout_s))
        except Exception as exc:
            if getattr(exc, "status", None) == 410:
                raise Gone() from None
            raise
        self._resp = resp
        try:
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                self._event(json.loads(line))
        finally:
            self._resp = None
            resp.release_conn()

    def _event(self, ev: dict) -> None:
        typ, obj = ev.get("type"), ev.get("object") or {}
        if typ == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = rv
        if typ == "BOOKMARK":
            return
        key = object_key(obj)
        if typ == DELETED:
            self.store.pop(key, None)
        else:
            self.store[key] = rv
        self.handler(typ, key, obj)


def _reason(exc: Exception) -> str:
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    status = getattr(exc, "status", None)
    if status:
        return f"http_{status}"
    if any(w in name for w in ("Protocol", "Connection", "MaxRetry")) or isinstance(exc, (ConnectionError, OSError)):
        return "connection"
    return "error"
