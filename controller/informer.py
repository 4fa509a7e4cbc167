"""List + watch of one resource, with raw JSON and the recovery rules of client-go's reflector.

Shared by the controller and the lab's pod agent (``lab/podagent.py``).

- Initial state: a watch-list stream where the API server offers it (``sendInitialEvents=true``,
  ``resourceVersionMatch=NotOlderThan``, bookmarks; Kubernetes' WatchList, on by default since
  v1.34): each initial ADDED event is handed to the handler as it arrives (new or changed
  against the cache; an ``on_list`` consumer gets them whole), and when the BOOKMARK
  annotated ``k8s.io/initial-events-end: "true"`` arrives, what the cache holds beyond them
  is deleted and the informer is synced; the same stream then carries on as the watch.
  A server that rejects it (or ends the stream without that bookmark) is listed instead, and
  this informer does not try watch-list again.
- List: ``resourceVersion="0"`` (the API server's watch cache) at first; after a 410 the list
  asks for the last seen resourceVersion; on 410 Gone or "Too large resource version" it falls
  back to a quorum list (``resourceVersion`` unset), as client-go does.
- Lists are paged as client-go's pager pages them (``limit`` 500, then ``continue``; a server
  that ignores ``limit`` answers in one page), and each page is parsed from raw JSON
  (``_preload_content=False``; no model objects) and handed over before the next is asked
  for: 30k Services are never all in memory as dicts at once. A continue token that expired
  (410) restarts the list in one page, as client-go's ``FullListIfExpired``. A relist emits
  the difference against the cache as adds/updates/deletes; the cache is never cleared to
  start over, so the datapath is never flushed.
- Watch from the last resourceVersion with bookmarks, ``timeoutSeconds`` random in
  [min, 2*min] (5-10 min: nodes do not reconnect in lockstep after an API server restart)
  and a client read timeout (90 s): the API server sends a bookmark about every minute, so a
  silent connection is dead. A read timeout or a broken connection re-watches from the last
  resourceVersion after a backoff; only 410 relists.
- Every event, BOOKMARK included, advances the resourceVersion.
- A handler that raises loses nothing: the object's latest event is kept and handed to the
  handler again (client-go's workqueue rate limiter: 5 ms doubling to 5 min per object)
  until it is taken, unless a newer event of the same object replaces it. Failures are
  logged with the object and counted (``on_handler_error``). Handlers of one informer never
  run at once, so a retried event cannot overtake a newer one.
- Backoff (client-go's ``DelayWithReset``): 0.8 s doubling to a 30 s cap, each delay jittered
  by up to +100 %, reset after 2 min without a backoff. HTTP 429 waits at least its
  Retry-After. A watch that ends within 1 s with no event backs off too (a proxy that closes
  watches cannot make us spin).
"""
from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("kxlb.informer")

ADDED, MODIFIED, DELETED, BOOKMARK = "ADDED", "MODIFIED", "DELETED", "BOOKMARK"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
Handler = Callable[[str, str, dict], None]  # (event type, "ns/name", object)


class Gone(Exception):
    """The resourceVersion is too old (HTTP 410): relist."""


class TooLarge(Exception):
    """The resourceVersion is newer than the server's ("Too large resource version")."""


class ShortWatch(Exception):
    """The watch ended at once with no event."""


class _NoWatchList(Exception):
    """The watch-list stream did not deliver the initial state: list instead. ``permanent``
    when the server does not serve watch-list at all (then it is not tried again)."""

    def __init__(self, msg: str, permanent: bool = False):
        super().__init__(msg)
        self.permanent = permanent


@dataclass
class WatchTiming:
    server_timeout_s: int = 300      # minimum watch timeoutSeconds; each watch asks for min..2*min
    read_timeout_s: float = 90       # socket read timeout: bookmarks come about every 60 s
    connect_timeout_s: float = 5
    backoff_initial_s: float = 0.8   # client-go: 800 ms
    backoff_max_s: float = 30        # cap of the base delay (jitter can add up to 100 %)
    backoff_reset_s: float = 120     # no backoff for this long: start again from the initial delay
    backoff_factor: float = 2.0
    backoff_jitter: float = 1.0
    short_watch_s: float = 1.0       # a watch ending sooner with no event backs off
    watch_list: bool = True          # try sendInitialEvents streams first
    page_size: int = 500             # objects per list page (client-go's pager); 0: one page


class Backoff:
    """client-go's ``wait.Backoff`` with ``DelayWithReset``: delay d, next min(d*factor, cap),
    each returned delay jittered to d*(1 + jitter*rand); reset to the initial delay when the
    previous backoff started more than ``reset`` seconds ago."""

    def __init__(self, initial: float, cap: float, reset: float, factor: float = 2.0, jitter: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random):
        self.initial, self.cap, self.reset, self.factor, self.jitter = initial, cap, reset, factor, jitter
        self.clock, self.rand = clock, rand
        self.duration = initial
        self.last: float | None = None

    @classmethod
    def from_timing(cls, t: WatchTiming) -> "Backoff":
        return cls(t.backoff_initial_s, t.backoff_max_s, t.backoff_reset_s, t.backoff_factor, t.backoff_jitter)

    def next(self) -> float:
        now = self.clock()
        if self.last is not None and now - self.last > self.reset:
            self.duration = self.initial
        self.last = now
        d = self.duration
        self.duration = min(d * self.factor, self.cap) if self.factor else d
        return d + (self.rand() * self.jitter * d if self.jitter > 0 else 0)


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


def _status_body(exc: Exception) -> dict:
    try:
        return json.loads(getattr(exc, "body", None) or "{}")
    except (TypeError, ValueError):
        return {}


def _too_large(status: dict) -> bool:
    """client-go's isTooLargeResourceVersionError, on a metav1.Status."""
    causes = (status.get("details") or {}).get("causes") or []
    if any(c.get("reason") == "ResourceVersionTooLarge" or c.get("message") == "Too large resource version"
           for c in causes):
        return True
    return "Too large resource version" in (status.get("message") or "")


def _classify(exc: Exception) -> Exception:
    """An ApiException that means Gone / TooLarge as such; anything else unchanged."""
    status = getattr(exc, "status", None)
    if status == 410:
        return Gone()
    if status in (504, 500) and _too_large(_status_body(exc)):
        return TooLarge()
    return exc


def _retry_after(exc: Exception) -> float:
    headers = getattr(exc, "headers", None) or {}
    try:
        value = headers.get("Retry-After")
    except AttributeError:
        value = None
    if value is None:
        value = ((_status_body(exc).get("details") or {}).get("retryAfterSeconds"))
    try:
        return min(max(float(value), 0.0), 600.0)
    except (TypeError, ValueError):
        return 0.0


class RetryQueue:
    """The latest failed event of each object, due again after a per-object backoff
    (client-go's ItemExponentialFailureRateLimiter: base * 2^failures, capped). Not
    thread-safe: the informer holds its delivery lock around every use."""

    def __init__(self, base: float = 0.005, cap: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.base, self.cap, self.clock = base, cap, clock
        self._items: dict[str, tuple[float, int, str, dict]] = {}   # key -> (due, failures, type, obj)

    def __len__(self) -> int:
        return len(self._items)

    def failed(self, key: str, typ: str, obj: dict) -> float:
        """Keep ``key``'s event for a retry; returns the delay before it."""
        failures = self._items[key][1] + 1 if key in self._items else 1
        delay = min(self.base * 2 ** (failures - 1), self.cap)
        self._items[key] = (self.clock() + delay, failures, typ, obj)
        return delay

    def forget(self, key: str) -> None:
        self._items.pop(key, None)

    def holds(self, key: str, obj: dict) -> bool:
        """Is ``obj`` still the event waiting for ``key``?"""
        item = self._items.get(key)
        return item is not None and item[3] is obj

    def due(self) -> list[tuple[str, str, dict]]:
        now = self.clock()
        return [(k, typ, obj) for k, (t, _, typ, obj) in sorted(self._items.items(), key=lambda i: i[1][0])
                if t <= now]

    def next_due(self) -> float | None:
        return min((t for t, _, _, _ in self._items.values()), default=None)


class Informer:
    """Keeps ``store`` equal to the server's view of one resource and calls ``handler``
    for every change. ``list_fn`` is a kubernetes-client list function (e.g.
    CoreV1Api.list_service_for_all_namespaces); ``kwargs`` its selectors.

    ``on_list(items)``, if given, receives every complete state (a list, or the initial
    events of a watch-list) instead of the add/update/delete difference against the cache."""

    def __init__(self, name: str, list_fn: Callable, handler: Handler, kwargs: dict | None = None,
                 timing: WatchTiming | None = None, on_restart: Callable[[str, str], None] | None = None,
                 on_list: Callable[[list[dict]], None] | None = None,
                 on_handler_error: Callable[[str, str, BaseException], None] | None = None):
        self.name, self.list_fn, self.handler = name, list_fn, handler
        self.on_handler_error = on_handler_error or (lambda resource, key, exc: None)
        self.retries = RetryQueue()
        # one handler call at a time, retries included; the retry thread holds it from
        # "is this still the latest event" to the handler's return (hence reentrant)
        self._deliver_lock = threading.RLock()
        self._retry_wake = threading.Event()
        self.kwargs = kwargs or {}
        self.timing = timing or WatchTiming()
        self.on_restart = on_restart or (lambda resource, reason: None)
        self.on_list = on_list
        # key -> resourceVersion: all a relist needs to tell what changed (the decoded
        # objects live in the handler's caches; raw JSON is not kept twice)
        self.store: dict[str, str] = {}
        self.resource_version: str | None = None   # the last one seen
        self.need_list = True                       # first sync, and after 410
        self.rv_unavailable = False                 # next list/watch-list: quorum read
        self.watch_list = self.timing.watch_list    # cleared when the server rejects it
        self.backoff = Backoff.from_timing(self.timing)
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._resp = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Informer":
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()
        return self

    # --- handing events over -------------------------------------------------------------------
    def _deliver(self, typ: str, key: str, obj: dict) -> bool:
        """Call the handler; a failure keeps the event for a retry (this one replaces any
        older event of the object waiting there). True when the handler took it."""
        with self._deliver_lock:
            try:
                self.handler(typ, key, obj)
            except Exception as exc:
                delay = self.retries.failed(key, typ, obj)
                log.error("%s: handling %s of %s failed (%s: %s); retrying in %.3fs", self.name, typ, key,
                          type(exc).__name__, exc, delay, exc_info=log.isEnabledFor(logging.DEBUG))
                try:
                    self.on_handler_error(self.name, key, exc)
                finally:
                    self._retry_wake.set()
                return False
            self.retries.forget(key)
            return True

    def retry_due(self) -> int:
        """Hand the failed events that are due to the handler again; how many it took."""
        with self._deliver_lock:
            due = self.retries.due()
        taken = 0
        for key, typ, obj in due:
            # Checked and handed over in one hold: a newer event of the object (taken, or
            # waiting in its place) must not be overtaken by this older one.
            with self._deliver_lock:
                if self.retries.holds(key, obj):
                    taken += self._deliver(typ, key, obj)
        return taken

    def _retry_loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._deliver_lock:
                    nxt = self.retries.next_due()
                wait = None if nxt is None else max(0.0, nxt - time.monotonic())
                self._retry_wake.wait(wait)
                self._retry_wake.clear()
                if not self._stop.is_set():
                    self.retry_due()
            except Exception:   # the retries must outlive any surprise
                log.exception("%s: retrying failed events", self.name)
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._retry_wake.set()
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            try:  # wakes the reader; close() would wait for the TLS lock the reader holds
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=1)  # a read blocked in the socket ends with the process

    def run(self) -> None:
        """The list/watch loop, in the calling thread, until stop(); failed events are
        retried by a thread of their own meanwhile."""
        threading.Thread(target=self._retry_loop, name=f"informer-{self.name}-retry", daemon=True).start()
        while not self._stop.is_set():
            try:
                if self.need_list:
                    if self.watch_list:
                        try:
                            self._watch_list()  # syncs, then carries on as the watch
                            continue
                        except _NoWatchList as exc:
                            log.info("%s: no watch-list (%s); listing instead", self.name, exc)
                            self.watch_list = not exc.permanent
                    self.relist()
                self._watch()
            except Gone:
                log.info("%s: resourceVersion %s is gone (410): relisting", self.name, self.resource_version)
                self.on_restart(self.name, "gone")
                self.need_list = True
            except TooLarge:
                log.info("%s: resourceVersion %s is too large: relisting from etcd", self.name, self.resource_version)
                self.on_restart(self.name, "gone")
                self.need_list = self.rv_unavailable = True
            except Exception as exc:  # connection refused, reset, read timeout, 5xx, 429, short watch ...
                if self._stop.is_set():
                    return
                reason = _reason(exc)
                self.on_restart(self.name, reason)
                delay = self.backoff.next()
                if getattr(exc, "status", None) == 429:
                    delay = max(delay, _retry_after(exc))
                log.warning("%s: %s (%s: %s); retrying in %.2fs", self.name,
                            "listing failed" if self.need_list else "watch ended", reason,
                            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__, delay)
                self._stop.wait(delay)

    # --- list ----------------------------------------------------------------------------------
    def list_resource_version(self) -> str:
        """client-go's relistResourceVersion: "" (quorum) after a 410/too-large list, the last
        seen version after a 410 watch, "0" (the watch cache) at first."""
        if self.rv_unavailable:
            return ""
        return self.resource_version or "0"

    def relist(self) -> None:
        """List page by page, each page's objects handed over (as the difference against the
        cache) before the next page is asked for; then what the cache holds beyond the list
        is deleted. An ``on_list`` consumer gets the pages whole, at the end."""
        rv = self.list_resource_version()
        limit, cont = self.timing.page_size, None
        seen: set[str] = set()
        whole: list[dict] = []
        list_rv, pages = None, 0
        while True:
            params: dict = {"limit": limit} if limit else {}
            if cont:
                params["_continue"] = cont   # the list's own snapshot: no resourceVersion with it
            elif rv:
                params["resource_version"] = rv
            try:
                data = self._list_page(params)
            except Exception as exc:
                err = _classify(exc)
                if not isinstance(err, (Gone, TooLarge)):
                    raise
                if cont:
                    log.info("%s: list continuation expired (%s); listing again in one page", self.name,
                             type(err).__name__)
                    limit, cont, list_rv, pages = 0, None, None, 0
                    seen, whole = set(), []
                    continue
                if rv:
                    log.info("%s: list at resourceVersion %s: %s; listing from etcd", self.name, rv,
                             type(err).__name__)
                    self.rv_unavailable, rv = True, ""
                    continue
                raise
            meta = data.get("metadata") or {}
            list_rv = list_rv or meta["resourceVersion"]
            items = data.get("items") or []
            pages += 1
            if self.on_list is not None:
                whole.extend(items)
            else:
                for obj in items:
                    self._initial(obj, seen)
            cont = meta.get("continue") or None
            del data, items
            if not cont:
                break
        if self.on_list is not None:
            self._replace(whole, list_rv)
        else:
            self._initial_end(seen, list_rv)
        log.info("%s: listed %d objects in %d page%s at resourceVersion %s (asked %r)", self.name,
                 len(whole) if self.on_list is not None else len(seen), pages, "" if pages == 1 else "s",
                 self.resource_version, rv)

    def _list_page(self, params: dict) -> dict:
        t = self.timing
        resp = self.list_fn(**self.kwargs, **params, _preload_content=False,
                            _request_timeout=(t.connect_timeout_s, t.read_timeout_s))
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def _replace(self, items: list[dict], rv: str) -> None:
        """A complete state for ``on_list``, whole."""
        self.store = {object_key(o): (o.get("metadata") or {}).get("resourceVersion") for o in items}
        self.on_list(items)
        self._synced_at(rv)

    def _initial(self, obj: dict, seen: set[str]) -> None:
        """One object of a complete state, handed over at once if it is new or changed (a
        watch-list's initial events are decoded as they arrive, not held until the end:
        30k Services are ~520 MB of dicts at once, one at a time is one)."""
        key = object_key(obj)
        seen.add(key)
        old_rv, orv = self.store.get(key), (obj.get("metadata") or {}).get("resourceVersion")
        self.store[key] = orv
        if old_rv is None:
            self._deliver(ADDED, key, obj)
        elif old_rv != orv:
            self._deliver(MODIFIED, key, obj)

    def _initial_end(self, seen: set[str], rv: str) -> None:
        """The complete state is in: what the cache holds beyond it was deleted meanwhile."""
        for key in [k for k in self.store if k not in seen]:
            del self.store[key]
            ns, _, name = key.partition("/")
            self._deliver(DELETED, key, {"metadata": {"namespace": ns, "name": name}})
        self._synced_at(rv)

    def _synced_at(self, rv: str) -> None:
        self.resource_version = rv
        self.need_list = self.rv_unavailable = False
        self.synced.set()

    # --- watch ---------------------------------------------------------------------------------
    def watch_timeout(self) -> int:
        """client-go: min + rand*(max-min), max = 2*min."""
        m = self.timing.server_timeout_s
        return int(m + random.random() * m)

    def _open(self, **params):
        t = self.timing
        try:
            resp = self.list_fn(**self.kwargs, **params, watch=True, allow_watch_bookmarks=True,
                                timeout_seconds=self.watch_timeout(), _preload_content=False,
                                _request_timeout=(t.connect_timeout_s, t.read_timeout_s))
        except Exception as exc:
            raise _classify(exc) from None
        self._resp = resp
        return resp

    def _watch_list(self) -> None:
        rv = "" if self.rv_unavailable else (self.resource_version or "")
        params = {"send_initial_events": True, "resource_version_match": "NotOlderThan"}
        if rv:
            params["resource_version"] = rv
        try:
            resp = self._open(**params)
        except (Gone, TooLarge):
            raise TooLarge() from None  # watch-list again, at a quorum read
        except Exception as exc:
            if getattr(exc, "status", None) in (400, 403, 404, 405, 422, 501):
                raise _NoWatchList(f"HTTP {exc.status}", permanent=True) from None
            raise
        self._consume(resp, initial={} if self.on_list is not None else set())

    def _watch(self) -> None:
        self._consume(self._open(resource_version=self.resource_version), initial=None)

    def _consume(self, resp, initial: dict | set | None) -> None:
        """Read a watch stream. ``initial``: a watch-list's initial events until the end
        bookmark, collected whole for ``on_list`` (a dict), else handed over as they come
        and their keys kept (a set); None once they are in (events applied as they come)."""
        started, events = time.monotonic(), 0
        try:
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                events += 1
                ev = json.loads(line)
                typ, obj = ev.get("type"), ev.get("object") or {}
                if typ == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone() if initial is None else TooLarge()  # watch-list: quorum next
                    if _too_large(obj):
                        raise TooLarge()
                    err = RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                    err.status = obj.get("code")
                    err.body = json.dumps(obj)
                    raise err
                md = obj.get("metadata") or {}
                if initial is not None:
                    if typ == BOOKMARK:
                        if (md.get("annotations") or {}).get(INITIAL_EVENTS_END) != "true":
                            raise _NoWatchList("a bookmark before the initial-events-end bookmark", permanent=True)
                        end_rv = md.get("resourceVersion") or self.resource_version
                        if isinstance(initial, set):
                            self._initial_end(initial, end_rv)
                        else:
                            self._replace(list(initial.values()), end_rv)
                        log.info("%s: watch-list: %d objects at resourceVersion %s", self.name,
                                 len(initial), self.resource_version)
                        initial = None
                    elif typ in (ADDED, MODIFIED):
                        if isinstance(initial, set):
                            self._initial(obj, initial)
                        else:
                            initial[object_key(obj)] = obj
                    elif typ == DELETED:
                        if isinstance(initial, set):
                            initial.discard(object_key(obj))  # gone from the cache at the end bookmark
                        else:
                            initial.pop(object_key(obj), None)
                    continue
                self._event(typ, obj)
        finally:
            self._resp = None
            resp.release_conn()
        if self._stop.is_set():
            return
        if initial is not None:
            raise _NoWatchList("the stream ended before the initial-events-end bookmark")
        if events == 0 and time.monotonic() - started < self.timing.short_watch_s:
            raise ShortWatch("very short watch: it ended at once with no event")

    def _event(self, typ: str, obj: dict) -> None:
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = rv
        if typ == BOOKMARK:
            return
        key = object_key(obj)
        if typ == DELETED:
            self.store.pop(key, None)
        else:
            self.store[key] = rv
        self._deliver(typ, key, obj)


def _reason(exc: Exception) -> str:
    name = type(exc).__name__
    if isinstance(exc, ShortWatch):
        return "short"
    if "Timeout" in name or isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    status = getattr(exc, "status", None)
    if status:
        return f"http_{status}"
    if any(w in name for w in ("Protocol", "Connection", "MaxRetry")) or isinstance(exc, (ConnectionError, OSError)):
        return "connection"
    return "error"
