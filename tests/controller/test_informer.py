"""The informer (controller/informer.py), as careful as client-go's reflector.

Against the real kube-apiserver of the session control plane: the first list at
resourceVersion "0", the quorum fallback on "Too large resource version", the relist after a
410, watch-list streaming, randomised watch timeouts. A small local HTTP server only for
what a real API server cannot be made to do on demand: 429 with Retry-After, watches closed
at once, a connection that goes silent, a server that rejects watch-list."""
from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse

import pytest

from conftest import make_service, put_slice   # at import: a later conftest takes the name
from kxlb.controller.informer import Backoff, Informer, WatchTiming, object_key


class Recorder:
    """Wraps a kubernetes-client list function; records each call's query arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, **kw):
        self.calls.append({k: v for k, v in kw.items()
                           if (k == "_continue" or not k.startswith("_")) and k not in ("namespace", "label_selector")})
        return self.fn(**kw)


class Events:
    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.restarts: list[str] = []

    def __call__(self, typ, key, obj):
        self.seen.append((typ, key))

    def restart(self, _res, reason):
        self.restarts.append(reason)

    def wait(self, item, timeout=10.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if item in self.seen:
                return
            time.sleep(0.02)
        raise AssertionError(f"{item} not seen; saw {self.seen}")


def configmaps(api, ns, *names):
    from kubernetes import client

    core = client.CoreV1Api(api)
    for n in names:
        core.create_namespaced_config_map(ns, {"metadata": {"name": n, "labels": {"kxlb-test": "informer"}},
                                               "data": {"k": n}}, _preload_content=False)


def cm_informer(api, ns, timing: WatchTiming, ev: Events):
    from kubernetes import client

    rec = Recorder(client.CoreV1Api(api).list_namespaced_config_map)
    return Informer("configmaps", rec, ev, {"namespace": ns, "label_selector": "kxlb-test=informer"},
                    timing, ev.restart), rec


class Flaky(Events):
    """A handler that raises on the first ``fails`` events of objects named ``bad``."""

    def __init__(self, bad: str, fails: int):
        super().__init__()
        self.bad, self.fails, self.errors = bad, fails, []
        self.data: dict[str, str] = {}

    def __call__(self, typ, key, obj):
        if key.endswith("/" + self.bad) and self.fails > 0:
            self.fails -= 1
            raise RuntimeError(f"handler failure {self.fails}")
        super().__call__(typ, key, obj)
        self.data[key] = (obj.get("data") or {}).get("k")

    def error(self, res, key, exc):
        self.errors.append((res, key, str(exc)))


@pytest.mark.parametrize("watch_list", [False, True], ids=["list", "watch-list"])
def test_a_handler_failure_is_retried_not_lost(api, ns, watch_list):
    """The object a handler raised on reaches it again (client-go's informer would have
    dropped it for good: the resourceVersion moved on), in the initial state and in the
    watch; each failure counted with the object."""
    from kubernetes import client

    configmaps(api, ns, "good", "bad")
    ev = Flaky("bad", fails=3)
    inf, _ = cm_informer(api, ns, WatchTiming(watch_list=watch_list), ev)
    inf.on_handler_error = ev.error
    inf.start()
    try:
        assert inf.synced.wait(10)
        ev.wait(("ADDED", f"{ns}/bad"), timeout=5)   # 5, 10, 20 ms later
        assert [e[:2] for e in ev.errors] == [("configmaps", f"{ns}/bad")] * 3
        assert ("ADDED", f"{ns}/good") in ev.seen and len(inf.retries) == 0
        # in the watch: two failures, then a newer version arrives before the retry
        ev.fails = 2
        inf.retries.base = 2.0   # the retry waits long enough for the update to overtake it
        core = client.CoreV1Api(api)
        core.patch_namespaced_config_map("bad", ns, {"data": {"k": "v2"}})
        wait_until(lambda: len(ev.errors) == 4)
        core.patch_namespaced_config_map("bad", ns, {"data": {"k": "v3"}})   # fails too, replaces v2
        wait_until(lambda: len(ev.errors) == 5)
        assert len(inf.retries) == 1
        wait_until(lambda: ev.data.get(f"{ns}/bad") == "v3", timeout=15)
        assert len(inf.retries) == 0 and ev.data[f"{ns}/bad"] == "v3"
    finally:
        inf.stop()


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- real API server
def test_first_list_from_watch_cache_then_watch_with_random_timeout(api, ns):
    configmaps(api, ns, "a", "b")
    ev = Events()
    inf, rec = cm_informer(api, ns, WatchTiming(watch_list=False), ev)
    inf.start()
    try:
        assert inf.synced.wait(10)
        assert rec.calls[0] == {"resource_version": "0", "limit": 500}  # the watch cache; no resourceVersionMatch
        assert {("ADDED", f"{ns}/a"), ("ADDED", f"{ns}/b")} <= set(ev.seen)
        configmaps(api, ns, "c")
        ev.wait(("ADDED", f"{ns}/c"))
        w = rec.calls[1]
        assert w["watch"] is True and w["allow_watch_bookmarks"] is True and w["resource_version"] not in ("", "0")
        assert 300 <= w["timeout_seconds"] <= 600
        assert len(rec.calls) == 2
    finally:
        inf.stop()
    timeouts = {inf.watch_timeout() for _ in range(50)}
    assert len(timeouts) > 10 and min(timeouts) >= 300 and max(timeouts) <= 600


@pytest.mark.parametrize("quorum", [False, True], ids=["watch-cache", "etcd"])
def test_a_list_is_paged_and_each_page_handed_over_before_the_next_is_asked_for(api, ns, quorum):
    """client-go's pager: ``limit`` then ``continue`` until the list ends; the handler has a
    page's objects before the next page is requested (never the whole list in memory), and
    the deletions of a relist come after the last page."""
    configmaps(api, ns, *(f"p{i:02d}" for i in range(12)))
    ev = Events()
    inf, rec = cm_informer(api, ns, WatchTiming(watch_list=False, page_size=5), ev)
    inf.rv_unavailable = quorum
    seen_at_call = []
    real = rec.fn
    rec.fn = lambda **kw: (seen_at_call.append(len(ev.seen)), real(**kw))[1]
    inf.store[f"{ns}/gone"] = "1"          # in the cache, not in the cluster: deleted at the end
    inf.relist()
    assert rec.calls[0].get("resource_version") == (None if quorum else "0")
    if quorum:
        assert [c.get("limit") for c in rec.calls] == [5, 5, 5]
        assert [bool(c.get("_continue")) for c in rec.calls] == [False, True, True]
        assert all("resource_version" not in c for c in rec.calls[1:])   # a continuation is its list's snapshot
        assert seen_at_call == [0, 5, 10]
    else:   # the v1.37 watch cache ignores the limit at resourceVersion "0": one page, taken as such
        assert [c.get("limit") for c in rec.calls] == [5] and seen_at_call == [0]
    assert sorted(ev.seen[:12]) == [("ADDED", f"{ns}/p{i:02d}") for i in range(12)]
    assert ev.seen[12:] == [("DELETED", f"{ns}/gone")] and inf.synced.is_set()


def test_list_too_large_resource_version_falls_back_to_quorum_list(api, ns):
    from kubernetes import client

    configmaps(api, ns, "a")
    rv = json.loads(client.CoreV1Api(api).list_namespaced_config_map(ns, _preload_content=False).data)
    ev = Events()
    inf, rec = cm_informer(api, ns, WatchTiming(watch_list=False), ev)
    future = str(int(rv["metadata"]["resourceVersion"]) + 1_000_000)
    inf.resource_version = future  # as if the last version seen came from the future
    inf.relist()
    assert [c.get("resource_version") for c in rec.calls] == [future, None]  # then a quorum read
    assert int(inf.resource_version) < int(future)
    assert inf.synced.is_set() and ("ADDED", f"{ns}/a") in ev.seen


def test_watch_410_relists_and_emits_the_difference(api, ns, cp):
    """A node whose watch was away while the API server restarted and etcd compacted: its
    resourceVersion is older than the new watch cache holds (410). It relists at that
    version and emits only the difference: the Service deleted meanwhile, the one added."""
    from kubernetes import client
    from kxlb.lab.controlplane import APISERVER
    from test_restarts import etcd_compact, restart_apiserver

    core = client.CoreV1Api(api)
    configmaps(api, ns, "a", "ghost")
    listed = json.loads(core.list_namespaced_config_map(ns, label_selector="kxlb-test=informer",
                                                        _preload_content=False).data)
    core.delete_namespaced_config_map("ghost", ns)
    configmaps(api, ns, "b")
    cp.kill(APISERVER)
    restart_apiserver(cp)
    etcd_compact(cp)
    ev = Events()
    inf, rec = cm_informer(api, ns, WatchTiming(watch_list=False), ev)
    inf.store = {object_key(o): o["metadata"]["resourceVersion"] for o in listed["items"]}  # as synced then
    inf.resource_version, inf.need_list = listed["metadata"]["resourceVersion"], False
    inf.start()
    try:
        ev.wait(("DELETED", f"{ns}/ghost"))
        ev.wait(("ADDED", f"{ns}/b"))
        assert "gone" in ev.restarts and ("MODIFIED", f"{ns}/a") not in ev.seen
        old = listed["metadata"]["resourceVersion"]
        assert rec.calls[0]["watch"] is True and rec.calls[0]["resource_version"] == old
        assert rec.calls[1] == {"resource_version": old, "limit": 500}  # client-go relists at the last version first
        assert set(inf.store) == {f"{ns}/a", f"{ns}/b"}
    finally:
        inf.stop()


def test_watch_list_streams_initial_state_then_events(api, ns):
    configmaps(api, ns, "a", "b")
    ev = Events()
    inf, rec = cm_informer(api, ns, WatchTiming(), ev)
    inf.start()
    try:
        assert inf.synced.wait(10)
        first = rec.calls[0]
        assert first["watch"] is True and first["send_initial_events"] is True
        assert first["resource_version_match"] == "NotOlderThan" and "resource_version" not in first
        assert 300 <= first["timeout_seconds"] <= 600
        assert sorted(ev.seen) == [("ADDED", f"{ns}/a"), ("ADDED", f"{ns}/b")]
        configmaps(api, ns, "c")
        ev.wait(("ADDED", f"{ns}/c"))
        assert len(rec.calls) == 1 and inf.watch_list  # no list: the same stream carries on
    finally:
        inf.stop()


# ----------------------------------------------------------------------------- fake server
class Fake:
    """A local HTTP server answering list and watch of configmaps from a script:
    script(kind, query, n) -> (status, headers, lines, hold). kind is list, watch or
    watchlist; n counts requests of that kind; hold keeps the connection open, silent."""

    def __init__(self, script):
        self.script, self.requests, self.release = script, [], threading.Event()
        fake = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked, as the API server streams watches

            def log_message(self, *a):
                pass

            def do_GET(self):
                q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                kind = ("watchlist" if q.get("sendInitialEvents") == "true" else "watch") if q.get("watch") == "true" else "list"
                n = sum(1 for k, _, _ in fake.requests if k == kind)
                fake.requests.append((kind, q, time.monotonic()))
                status, headers, lines, hold = fake.script(kind, q, n)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                for line in lines:
                    data = json.dumps(line).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                if hold:
                    fake.release.wait(30)
                    return
                self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def informer(self, timing: WatchTiming, ev: Events) -> Informer:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.srv.server_address[1]}"
        core = client.CoreV1Api(client.ApiClient(cfg))
        return Informer("configmaps", core.list_namespaced_config_map, ev, {"namespace": "x"}, timing, ev.restart)

    def kinds(self):
        return [k for k, _, _ in self.requests]

    def close(self):
        self.release.set()
        self.srv.shutdown()


def cm(name, rv):
    return {"metadata": {"namespace": "x", "name": name, "resourceVersion": rv}}


LIST = (200, {}, [{"kind": "ConfigMapList", "metadata": {"resourceVersion": "10"}, "items": [cm("a", "9")]}], False)
FAST = dict(watch_list=False, backoff_initial_s=0.05, backoff_max_s=0.4)


@pytest.fixture
def fake():
    made = []

    def make(script):
        made.append(Fake(script))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_429_honours_retry_after(fake):
    # The API server's 429 carries Retry-After. urllib3 retries a GET up to 3 times after it;
    # then the 429 reaches the informer, which must wait at least as long too (its own
    # backoff here is 0.05-0.1 s).
    status = {"kind": "Status", "code": 429, "reason": "TooManyRequests", "details": {"retryAfterSeconds": 1}}
    srv = fake(lambda kind, q, n: LIST if kind == "list" else
               (429, {"Retry-After": "1"}, [status], False) if n < 6 else (200, {}, [], True))
    ev = Events()
    inf = srv.informer(WatchTiming(**FAST), ev).start()
    try:
        end = time.monotonic() + 15
        while srv.kinds().count("watch") < 7 and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        inf.stop()
    watches = [(t, q["timeoutSeconds"]) for k, q, t in srv.requests if k == "watch"]
    assert len(watches) >= 7, srv.kinds()
    gaps = [b[0] - a[0] for a, b in zip(watches[:7], watches[1:7])]
    assert min(gaps) >= 0.9, gaps
    assert len({ts for _, ts in watches[:7]}) >= 2  # the informer itself retried (a new timeoutSeconds)
    assert "http_429" in ev.restarts and srv.kinds().count("list") == 1


def test_watch_closed_at_once_backs_off(fake):
    srv = fake(lambda kind, q, n: LIST if kind == "list" else (200, {}, [], False))
    ev = Events()
    inf = srv.informer(WatchTiming(**FAST), ev).start()
    try:
        time.sleep(2.0)
    finally:
        inf.stop()
    watches = [t for k, _, t in srv.requests if k == "watch"]
    # 0.05, 0.1, 0.2, 0.4, 0.4... (+0-100 % jitter) -> at most ~9 watches in 2 s; spinning: hundreds
    assert 3 <= len(watches) <= 10, len(watches)
    gaps = [b - a for a, b in zip(watches, watches[1:])]
    assert gaps[0] >= 0.05 and max(gaps) >= 0.2
    assert set(ev.restarts) == {"short"} and srv.kinds().count("list") == 1  # re-watch, never relist


def test_silent_connection_times_out_and_rewatches_from_last_version(fake):
    def script(kind, q, n):
        if kind == "list":
            return LIST
        return 200, {}, [{"type": "ADDED", "object": cm("b", "11")}] if n == 0 else [], True

    srv = fake(script)
    ev = Events()
    inf = srv.informer(WatchTiming(read_timeout_s=1, **FAST), ev).start()
    try:
        end = time.monotonic() + 6
        while srv.kinds().count("watch") < 2 and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        inf.stop()
    watches = [q for k, q, _ in srv.requests if k == "watch"]
    assert len(watches) >= 2, srv.kinds()
    assert watches[0]["resourceVersion"] == "10" and watches[1]["resourceVersion"] == "11"
    assert ev.restarts[0] == "timeout" and srv.kinds().count("list") == 1
    assert ("ADDED", "x/b") in ev.seen


def test_watch_list_rejected_falls_back_to_list(fake):
    invalid = {"kind": "Status", "code": 422, "reason": "Invalid",
               "message": "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled"}
    srv = fake(lambda kind, q, n: LIST if kind == "list" else (422, {}, [invalid], False) if kind == "watchlist"
               else (200, {}, [], True))
    ev = Events()
    inf = srv.informer(WatchTiming(backoff_initial_s=0.05), ev).start()
    try:
        assert inf.synced.wait(5)
        end = time.monotonic() + 5
        while "watch" not in srv.kinds() and time.monotonic() < end:
            time.sleep(0.05)
        assert srv.kinds()[:3] == ["watchlist", "list", "watch"]
        assert not inf.watch_list and ev.seen == [("ADDED", "x/a")]
    finally:
        inf.stop()


def test_an_expired_continue_token_lists_again_in_one_page(fake, caplog):
    """The API server compacted the list's snapshot between two pages (410 on the continue
    token): client-go's pager lists again without a limit; nothing is lost or doubled."""
    page1 = (200, {}, [{"kind": "ConfigMapList", "metadata": {"resourceVersion": "10", "continue": "tok"},
                        "items": [cm("a", "9")]}], False)
    expired = (410, {}, [{"kind": "Status", "code": 410, "reason": "Expired",
                          "message": "The provided continue parameter is too old"}], False)
    full = (200, {}, [{"kind": "ConfigMapList", "metadata": {"resourceVersion": "12"},
                       "items": [cm("a", "11"), cm("b", "12")]}], False)
    srv = fake(lambda kind, q, n: (page1 if "limit" in q and "continue" not in q else expired if "continue" in q
                                   else full) if kind == "list" else (200, {}, [], True))
    ev = Events()
    inf = srv.informer(WatchTiming(**FAST), ev)
    caplog.set_level("INFO", logger="kxlb.informer")
    inf.relist()
    lists = [q for k, q, _ in srv.requests if k == "list"]
    assert [("limit" in q, q.get("continue")) for q in lists] == [(True, None), (True, "tok"), (False, None)]
    assert ev.seen == [("ADDED", "x/a"), ("MODIFIED", "x/a"), ("ADDED", "x/b")]
    assert inf.resource_version == "12" and inf.store == {"x/a": "11", "x/b": "12"}
    assert "listed 2 objects in 1 page at" in caplog.text  # the list that counted, not the pages thrown away


# ----------------------------------------------------------------------------- backoff numbers
def test_backoff_is_client_gos():
    now = [0.0]
    t = WatchTiming()
    low = Backoff(t.backoff_initial_s, t.backoff_max_s, t.backoff_reset_s, clock=lambda: now[0], rand=lambda: 0.0)
    assert [round(low.next(), 3) for _ in range(8)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30, 30]
    now[0] += 119
    assert low.next() == 30  # not 2 min without a backoff yet
    now[0] += 121
    assert low.next() == pytest.approx(0.8)  # healthy for 2 min: reset
    high = Backoff(0.8, 30, 120, clock=lambda: now[0], rand=lambda: 1.0)
    assert [round(high.next(), 3) for _ in range(7)] == [1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 60]


def test_watch_list_hands_each_initial_object_over_as_it_arrives(fake):
    """The initial state is decoded object by object (30k Services held as raw dicts until
    the end bookmark were ~520 MB), yet the informer is synced, and objects the cache held
    but the state lacks are deleted, only at the end bookmark."""
    end = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20", "annotations": {
        "k8s.io/initial-events-end": "true"}}}}
    stream = [{"type": "ADDED", "object": cm("a", "11")}, {"type": "ADDED", "object": cm("b", "12")}]
    def script(kind, q, n):
        if kind == "watchlist" and n == 0:
            return 200, {}, stream, True   # the initial objects, then silence: no end bookmark yet
        if kind == "watchlist":
            return 200, {}, stream + [end], True
        return 200, {}, [], True
    srv = fake(script)
    ev = Events()
    inf = srv.informer(WatchTiming(backoff_initial_s=0.05, read_timeout_s=1.5), ev)
    inf.store = {"x/a": "5", "x/gone": "6"}   # what an earlier sync left in the cache
    inf.start()
    try:
        ev.wait(("ADDED", "x/b"), timeout=5)
        assert ev.seen == [("MODIFIED", "x/a"), ("ADDED", "x/b")] and not inf.synced.is_set()
        assert "x/gone" in inf.store
        # the silent stream times out (no bookmark: not a complete state); the next one ends it
        assert inf.synced.wait(10)
        assert ("DELETED", "x/gone") in ev.seen and inf.resource_version == "20"
        assert set(inf.store) == {"x/a", "x/b"} and inf.watch_list
    finally:
        inf.stop()


def test_the_controllers_selectors_are_kube_proxys(api, ns):
    """Services: not another proxy's, not headless (by field: never sent); EndpointSlices:
    not a headless Service's, whatever their proxy-name label (kube-proxy's informers)."""
    from kubernetes import client

    from kxlb.controller.controller import SERVICE_SELECTOR, SLICE_SELECTOR

    other = {"service.kubernetes.io/service-proxy-name": "someone-else"}
    make_service(api, ns, "mine", [("http", 80, "TCP")], [("10.1.0.1", {"ready": True})])
    make_service(api, ns, "other", [("http", 80, "TCP")], [("10.1.0.2", {"ready": True})], labels=other)
    make_service(api, ns, "headless", [("http", 80, "TCP")], [], cluster_ip="None")
    put_slice(api, ns, "headless", [("10.1.0.3", {"ready": True})], [("http", 80, "TCP")],
              labels={"service.kubernetes.io/headless": ""})
    seen = {}
    for name, fn, selector in (
            ("services", client.CoreV1Api(api).list_namespaced_service, SERVICE_SELECTOR),
            ("slices", client.DiscoveryV1Api(api).list_namespaced_endpoint_slice, SLICE_SELECTOR)):
        ev = Events()
        inf = Informer(name, fn, ev, {"namespace": ns, **selector}, WatchTiming(), ev.restart).start()
        try:
            assert inf.synced.wait(10)
            seen[name] = sorted(k.split("/")[1] for _, k in ev.seen)
        finally:
            inf.stop()
    assert seen == {"services": ["mine"], "slices": ["mine-1", "other-1"]}
