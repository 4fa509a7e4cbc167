"""Warning Events about skipped objects (controller/events.py): posted to the real API
server off the caller's thread, once per object version, at most a burst of 25 per object."""
from __future__ import annotations

import socket
import time

from kxlb.controller.events import BURST, EventRecorder


def events_about(api, ns: str, name: str) -> list[dict]:
    from kubernetes import client

    items = client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    return [e for e in items if e.source.component == "kxlb"]


def settle(rec: EventRecorder, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while rec.pending:
        assert time.monotonic() < end, f"{rec.pending} events still queued"
        time.sleep(0.05)


def bad_service(ns: str, version: int) -> dict:
    return {"metadata": {"namespace": ns, "name": "bad", "uid": "u-1", "resourceVersion": str(version)}}


def test_one_event_per_object_version_and_a_burst_of_25_per_object(api, ns):
    rec = EventRecorder(api, "node-a")
    rec.warn("Service", bad_service(ns, 1), "KxlbInvalidObject", "spec.ports[0].port: 0 is not a port")
    rec.warn("Service", bad_service(ns, 1), "KxlbInvalidObject", "spec.ports[0].port: 0 is not a port")
    settle(rec)
    (ev,) = events_about(api, ns, "bad")
    assert (ev.reason, ev.type, ev.message, ev.involved_object.kind, ev.source.host) == \
        ("KxlbInvalidObject", "Warning", "spec.ports[0].port: 0 is not a port", "Service", "node-a")
    for version in range(2, 2 + 2 * BURST):   # an object rewritten in a loop
        rec.warn("Service", bad_service(ns, version), "KxlbInvalidObject", f"version {version}")
    settle(rec)
    assert len(events_about(api, ns, "bad")) == BURST and (rec.dropped, rec.failed) == (BURST + 1, 0)


def test_warn_only_queues_while_the_api_server_does_not_answer():
    """The controller calls warn() under its lock: a silent API server must not hold it."""
    from kubernetes import client

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)   # connections are queued, never accepted nor answered
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        rec = EventRecorder(client.ApiClient(cfg), "node-a")
        for version in range(3):
            rec.warn("Service", bad_service("default", version), "KxlbInvalidObject", "bad")
        assert rec.pending == 3 and rec.posted == 0
    finally:
        silent.close()
