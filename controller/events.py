"""Kubernetes Events about objects the controller had to skip (a malformed Service, an
EndpointSlice with a bad address): what `kubectl describe` shows their owners.

Events are best effort and must never hold up programming: ``warn`` is called from the
informers' handlers (some under the controller's or the tracker's lock), so it only
queues. One thread posts,
each request with a timeout. What client-go's recorder does against spam, here too:
- one Event per object version (the same bad object seen again at a relist says nothing new:
  the last version warned about is remembered);
- per object, a token bucket of 25 with one more every 5 minutes
  (EventSourceObjectSpamFilter's defaults): an object rewritten in a loop cannot flood etcd;
- a bounded queue (1,000): when the API server is slow, further Events are dropped and counted.
"""
from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable

log = logging.getLogger("kxlb.events")

BURST = 25                 # client-go: defaultSpamBurst
REFILL_S = 300.0           # client-go: defaultSpamQPS 1/300
QUEUE_MAX = 1000           # client-go: maxQueuedEvents
REQUEST_TIMEOUT_S = 5.0
REMEMBERED = 4096          # objects whose versions and buckets are remembered (least recent forgotten)


class _Bucket:
    def __init__(self, now: float):
        self.tokens, self.at = float(BURST), now

    def take(self, now: float) -> bool:
        self.tokens = min(BURST, self.tokens + (now - self.at) / REFILL_S)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class EventRecorder:
    """Warning Events from this node's controller, posted off the caller's thread."""

    def __init__(self, api_client, node_name: str, clock: Callable[[], float] = time.monotonic):
        from kubernetes import client as k8s

        self.core, self.node, self.clock = k8s.CoreV1Api(api_client), node_name, clock
        self._lock = threading.Lock()   # informer threads call warn() at once
        self._objects: OrderedDict[tuple, tuple[str | None, _Bucket]] = OrderedDict()
        self._queue: queue.Queue = queue.Queue(QUEUE_MAX)
        self.posted = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._post_loop, name="events", daemon=True)
        self._thread.start()

    def warn(self, kind: str, obj: dict, reason: str, message: str) -> None:
        """Queue a Warning about ``obj``; never blocks."""
        md = obj.get("metadata") or {}
        ident = (kind, md.get("namespace"), md.get("name"))
        version = md.get("resourceVersion")
        with self._lock:
            now = self.clock()
            last, bucket = self._objects.pop(ident, None) or ("", _Bucket(now))
            self._objects[ident] = (version, bucket)   # most recent last
            while len(self._objects) > REMEMBERED:
                self._objects.popitem(last=False)
            if version == last:
                return
            if not bucket.take(now):
                self.dropped += 1
                log.debug("event about %s %s/%s dropped: more than %d in a row", kind, ident[1], ident[2], BURST)
                return
        try:
            self._queue.put_nowait(self._event(kind, md, reason, message))
        except queue.Full:
            with self._lock:
                self.dropped += 1
            log.debug("event about %s %s/%s dropped: %d waiting", kind, ident[1], ident[2], QUEUE_MAX)

    @property
    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def _event(self, kind: str, md: dict, reason: str, message: str) -> dict:
        now = dt.datetime.now(dt.timezone.utc).isoformat()
        return {"metadata": {"generateName": f"{md.get('name', 'object')}.", "namespace": md.get("namespace") or "default"},
                "involvedObject": {"kind": kind, "namespace": md.get("namespace"), "name": md.get("name"),
                                   "uid": md.get("uid"), "resourceVersion": md.get("resourceVersion")},
                "reason": reason, "message": message[:1000], "type": "Warning",
                "source": {"component": "kxlb", "host": self.node},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}

    def _post_loop(self) -> None:
        while True:
            body = self._queue.get()
            try:
                self.core.create_namespaced_event(body["metadata"]["namespace"], body, _preload_content=False,
                                                  _request_timeout=REQUEST_TIMEOUT_S)
                self.posted += 1
            except Exception as exc:  # best effort: the log line about the object was written already
                self.failed += 1
                log.debug("event not recorded: %s", exc)
            finally:
                self._queue.task_done()
