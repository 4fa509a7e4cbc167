"""The controller's HTTP servers (health port, metrics port, healthCheckNodePorts: all
controller/httpserve.py) against hostile clients, on both address families, and
listening before the slow start-up. Loopback only; no API server."""
from __future__ import annotations

import http.client
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time

import pytest

from kxlb.controller.health import ProxyHealth, serve_health
from kxlb.controller.healthcheck import HealthCheckServers
from kxlb.controller.httpserve import HEAD_TIMEOUT, IDLE_TIMEOUT, MAX_CONNECTIONS, MAX_HEAD
from kxlb.controller.main import bind_address
from kxlb.controller.metrics import Metrics, serve
from kxlb.loader.errors import KxlbError

SLACK = 1.0  # the server checks its deadlines every 0.25 s; the rest is scheduling


def free_port() -> int:
    """A TCP port free on both families of loopback."""
    with socket.socket(socket.AF_INET6) as s:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
        return s.getsockname()[1]


def request(host: str, port: int, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, dict(r.headers), r.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes) -> tuple[bytes, bytes]:
    """Send ``data``, read until the server closes: (response head, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(data)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return head, body


def closed_after(socks: list[socket.socket], limit: float) -> list[float | None]:
    """Seconds until the server closed each socket (None: still open after ``limit``)."""
    t0, out = time.monotonic(), [None] * len(socks)
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(socks):
            sel.register(s, selectors.EVENT_READ, i)
        while None in out and time.monotonic() - t0 < limit:
            for key, _ in sel.select(0.05):
                try:
                    eof = key.fileobj.recv(65536) == b""
                except ConnectionResetError:
                    eof = True
                if eof:
                    out[key.data] = time.monotonic() - t0
                    sel.unregister(key.fileobj)
    return out


V4, V6 = ("ns/web", "IPv4"), ("ns/web", "IPv6")


def listen_on(addresses: tuple[str, ...] | None) -> dict[str, tuple[str, ...] | None]:
    """Each family's listen addresses from a list of both (None: every address of each)."""
    if addresses is None:
        return {"IPv4": None, "IPv6": None}
    return {"IPv4": tuple(a for a in addresses if ":" not in a), "IPv6": tuple(a for a in addresses if ":" in a)}


def health_check_servers(port: int, addresses: tuple[str, ...] | None, local_endpoints: int = 1,
                         local_endpoints6: int | None = None) -> HealthCheckServers:
    """A dual-stack Service's health check servers (IPv4 and IPv6 counts)."""
    hcs = HealthCheckServers(lambda: True)
    n6 = local_endpoints if local_endpoints6 is None else local_endpoints6
    hcs.sync({V4: (port, local_endpoints), V6: (port, n6)}, listen_on(addresses))
    return hcs


@pytest.fixture
def health() -> ProxyHealth:
    h = ProxyHealth(60)
    h.set_node({"metadata": {"name": "n"}})
    return h


@pytest.fixture
def health_port(health):
    port = free_port()
    srv = serve_health(health, "127.0.0.1", port)
    yield port
    srv.close()


@pytest.fixture
def many_files():
    """Room for a few thousand sockets on each side."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * 2100 + 1024
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_thousands_of_idle_connections_take_no_thread_and_probes_are_still_answered(health_port, many_files):
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    idle = [socket.create_connection(("127.0.0.1", health_port), timeout=5) for _ in range(2100)]
    try:
        status, _, body = request("127.0.0.1", health_port, "/livez")
        assert status == 200 and json.loads(body)["healthy"] is True
        assert len(os.listdir("/proc/self/task")) <= threads, "a thread per connection"
        # The server keeps at most MAX_CONNECTIONS: the oldest waiting ones were closed
        # to make room (the probe, the newest, was served).
        closed = closed_after(idle, 5)
        assert sum(t is not None for t in closed) >= len(idle) - MAX_CONNECTIONS
        assert closed[0] is not None and closed[-1] is None
        assert len(os.listdir("/proc/self/fd")) - fds - len(idle) <= MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()


def test_a_silent_connection_and_an_idle_kept_alive_one_are_closed_after_their_timeouts(health_port):
    silent = socket.create_connection(("127.0.0.1", health_port))
    conn = http.client.HTTPConnection("127.0.0.1", health_port, timeout=5)
    conn.request("GET", "/livez")
    r = conn.getresponse()
    assert r.status == 200 and r.read() and not r.will_close  # HTTP/1.1 keep-alive
    try:
        silent_at, idle_at = closed_after([silent, conn.sock], max(HEAD_TIMEOUT, IDLE_TIMEOUT) + SLACK)
    finally:
        silent.close()
        conn.close()
    assert silent_at is not None and HEAD_TIMEOUT - 0.5 <= silent_at <= HEAD_TIMEOUT + SLACK, silent_at
    assert idle_at is not None and IDLE_TIMEOUT - 0.5 <= idle_at <= IDLE_TIMEOUT + SLACK, idle_at


def test_a_slowloris_client_is_cut_off_at_the_head_deadline(health_port):
    """A byte every half second keeps any per-read timeout happy; the head's total
    deadline does not."""
    with socket.create_connection(("127.0.0.1", health_port)) as c:
        t0 = time.monotonic()
        c.sendall(b"GET /livez HTTP/1.1\r\nX-Slow: ")
        cut = None
        while time.monotonic() - t0 < HEAD_TIMEOUT + SLACK:
            if closed_after([c], 0.5)[0] is not None:
                cut = time.monotonic() - t0
                break
            try:
                c.send(b"a")
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic() - t0
                break
    assert cut is not None, "still connected after the head deadline"
    assert cut >= HEAD_TIMEOUT - 0.5, cut


def test_a_request_head_larger_than_the_limit_gets_431(health_port):
    head, body = raw_exchange(health_port, b"GET /livez HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"\r\nConnection: close" in head


def test_the_listen_backlog_is_somaxconn(health_port):
    """Send-Q of a listening socket is its backlog (http.server's was 5)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{health_port}"], capture_output=True, text=True,
                         check=True).stdout.split()
    with open("/proc/sys/net/core/somaxconn") as f:
        assert int(out[2]) == int(f.read())


def test_head_is_get_without_its_body_and_other_methods_get_405(health, health_port):
    hc_port = free_port()
    hcs = health_check_servers(hc_port, ("127.0.0.1",))
    try:
        for port, path in ((health_port, "/healthz"), (health_port, "/nope"), (hc_port, "/")):
            status, headers, body = request("127.0.0.1", port, path)
            head, raw_body = raw_exchange(port, f"HEAD {path} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
            assert head.startswith(f"HTTP/1.1 {status} ".encode()) and raw_body == b""
            assert f"\r\nContent-Length: {len(body)}".encode() in head  # the GET body's length
            status, headers, _ = request("127.0.0.1", port, path, method="POST")
            assert status == 405 and headers["Allow"] == "GET, HEAD"
    finally:
        hcs.close()


def test_health_server_on_ipv6(health):
    port = free_port()
    counted = []
    srv = serve_health(health, "::1", port, on_request=lambda path, code: counted.append((path, code)))
    try:
        status, headers, body = request("::1", port, "/healthz?verbose")
        doc = json.loads(body)
        assert (status, headers["Content-Type"], doc["healthy"], doc["nodeEligible"]) == \
            (200, "application/json", True, True)
        assert request("::1", port, "/livez")[0] == 200
        assert request("::1", port, "/metrics")[:3:2] == (404, b"404 page not found\n")
        assert counted == [("healthz", 200), ("livez", 200)]
    finally:
        srv.close()


def test_metrics_server_on_ipv6(health):
    port, metrics = free_port(), Metrics()
    srv = serve(metrics, "::1", port, health=health)
    try:
        status, headers, body = request("::1", port, "/metrics")
        assert status == 200 and b"kxlb_sync_proxy_rules_duration_seconds" in body
        assert request("::1", port, "/proxyMode")[::2] == (200, b"kxlb")
        assert request("::1", port, "/readyz")[0] == 503
        metrics.ready.set()
        assert request("::1", port, "/readyz")[::2] == (200, b"ok\n")
        # kube-proxy's metrics port answers /healthz with client-go's ping check: "ok" while
        # the process answers, whatever the node (the proxy's health is the health port's)
        health.set_node(None)
        assert request("::1", port, "/healthz")[::2] == (200, b"ok")
        assert json.loads(request("::1", port, "/livez")[2])["healthy"] is True
    finally:
        srv.close()


def test_health_check_servers_listen_on_each_address_of_both_families():
    port = free_port()
    hcs = health_check_servers(port, ("127.0.0.1", "::1"), local_endpoints=2)
    try:
        assert hcs.ports == {V4: port, V6: port}
        for host in ("127.0.0.1", "::1"):
            status, headers, body = request(host, port, "/")
            assert (status, headers["X-Load-Balancing-Endpoint-Weight"], json.loads(body)) == \
                (200, "2", {"service": {"namespace": "ns", "name": "web"}, "localEndpoints": 2,
                            "serviceProxyHealthy": True})
        hcs.sync({V4: (port, 0), V6: (port, 0)}, listen_on(("127.0.0.1", "::1")))
        assert request("::1", port, "/")[0] == 503
    finally:
        hcs.close()
    for host in ("127.0.0.1", "::1"):
        with pytest.raises(ConnectionRefusedError):
            request(host, port, "/")


@pytest.mark.parametrize("addresses", [("127.0.0.1", "::1"), None], ids=["node addresses", "every address"])
def test_each_family_answers_with_its_own_local_endpoints(addresses):
    """kube-proxy's proxier of each family serves the port on its family's addresses and
    counts its family's endpoints: a probe over IPv6 is told about IPv6 endpoints."""
    port = free_port()
    hcs = health_check_servers(port, addresses, local_endpoints=2, local_endpoints6=0)
    try:
        assert request("127.0.0.1", port, "/")[0] == 200
        status, headers, body = request("::1", port, "/")
        assert (status, headers["X-Load-Balancing-Endpoint-Weight"], json.loads(body)["localEndpoints"]) == \
            (503, "0", 0)
        # an IPv4-only Service: nothing listens on IPv6
        hcs.sync({V4: (port, 2)}, listen_on(addresses))
        assert hcs.ports == {V4: port}
        assert request("127.0.0.1", port, "/")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            request("::1", port, "/")
    finally:
        hcs.close()


def test_a_family_whose_port_is_taken_leaves_the_other_family_listening():
    port, failed = free_port(), []
    taken = socket.socket(socket.AF_INET6)
    taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    taken.bind(("::1", port))
    taken.listen()
    hcs = HealthCheckServers(lambda: True, on_error=lambda svc, p, exc: failed.append((svc, p)))
    try:
        hcs.sync({V4: (port, 1), V6: (port, 1)}, listen_on(("127.0.0.1", "::1")))
        assert failed == [("ns/web", port)] and hcs.ports == {V4: port}
        assert request("127.0.0.1", port, "/")[0] == 200
        taken.close()
        hcs.sync({V4: (port, 1), V6: (port, 1)}, listen_on(("127.0.0.1", "::1")))  # retried next sync
        assert hcs.ports == {V4: port, V6: port} and request("::1", port, "/")[0] == 200
    finally:
        taken.close()
        hcs.close()


@pytest.mark.parametrize("host", ["::", "0.0.0.0", "health check ports on every address"])
def test_a_wildcard_listener_serves_both_families_as_go_does(health, host):
    port = free_port()
    srv = health_check_servers(port, None) if host.startswith("health") else serve_health(health, host, port)
    try:
        for client in ("127.0.0.1", "::1"):
            assert request(client, port, "/livez")[0] == 200
    finally:
        srv.close()


def test_bind_address_takes_ip_port_and_bracketed_ipv6_and_nothing_else():
    flag = "--healthz-bind-address"
    assert bind_address("[::]:10256", flag) == ("::", 10256)
    assert bind_address("[fd00::1]:80", flag) == ("fd00::1", 80)
    assert bind_address("0.0.0.0:10249", flag) == ("0.0.0.0", 10249)
    assert bind_address(":10256", flag) == ("0.0.0.0", 10256)
    for bad, why in (("localhost:10256", "'localhost' is not an IP address"),
                     ("[fd00::zz]:80", "'fd00::zz' is not an IP address"),
                     ("10.0.0.1.5:80", "'10.0.0.1.5' is not an IP address"),
                     ("[::1]", "expected IP:PORT"), ("10.0.0.1:70000", "expected IP:PORT")):
        with pytest.raises(KxlbError) as err:
            bind_address(bad, flag)
        assert str(err.value).startswith(f"{flag} {bad!r}: ") and why in str(err.value)


# `kxlb controller` whose datapath compile (prepare_in_child) takes a minute.
SLOW_START = """
import sys, time
from kxlb.controller import main
main.prepare_in_child = lambda pin_dir, cgroup: time.sleep(60)
from kxlb.cli import main as cli
sys.exit(cli(sys.argv[1:]))
"""


def test_the_controller_listens_before_the_datapath_compile(pin_dirs):
    hport, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_START, "controller", "--node-name", "n",
                             "--kubeconfig", "/nonexistent", "--pin-dir", pin_dirs(), "--iface", "lo",
                             "--healthz-bind-address", f"127.0.0.1:{hport}",
                             "--metrics-bind-address", f"[::1]:{mport}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 15
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                status, _, body = request("127.0.0.1", hport, "/livez")
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end, "not listening 15 s after start"
                time.sleep(0.1)
        assert status == 200 and json.loads(body)["healthy"] is True  # alive: not restarted
        assert request("::1", mport, "/readyz")[0] == 503                 # not synced
        status, _, body = request("127.0.0.1", hport, "/healthz")         # the Node not seen yet
        assert status == 503 and json.loads(body)["nodeEligible"] is False
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
