"""The relay's HTTP CONNECT proxy (lab/relay.py), the API server's egress into a
kubelet lab: it must dial from inside the lab's namespace, tunnel bytes both ways, and
answer what it cannot serve with an HTTP error (the API server reports that)."""
from __future__ import annotations

import socket
import subprocess
import threading
import uuid

import pytest

from kxlb.lab.relay import ConnectProxy
from kxlb.loader.netns import netns


@pytest.fixture
def lab_ns():
    name = f"kxt-relay-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=False)


def _echo_server(ns: str) -> socket.socket:
    """An upper-casing echo server on 127.0.0.1 of namespace *ns* (not the host's)."""
    with netns(ns):
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                while data := c.recv(4096):
                    c.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _connect(path: str, request: bytes) -> tuple[socket.socket, bytes]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(path)
    c.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        data = c.recv(1)
        if not data:
            break
        head += data
    return c, head


def test_connect_tunnels_to_a_target_inside_the_namespace(lab_ns, tmp_path):
    srv = _echo_server(lab_ns)
    port = srv.getsockname()[1]
    proxy = ConnectProxy(str(tmp_path / "cluster.sock"), lab_ns)
    try:
        # Bytes sent with the request (after the empty line) reach the target first.
        c, head = _connect(proxy.path, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\nhello ".encode())
        assert head.startswith(b"HTTP/1.1 200 "), head
        c.sendall(b"kubelet")
        got = b""
        while len(got) < len(b"HELLO KUBELET"):
            got += c.recv(4096)
        assert got == b"HELLO KUBELET"
        c.shutdown(socket.SHUT_WR)
        assert c.recv(4096) == b""  # the target's close comes back through the tunnel
        c.close()
    finally:
        proxy.close()
        srv.close()


@pytest.mark.parametrize("request_line, why", [
    (b"GET / HTTP/1.1", "not a CONNECT"),
    (b"CONNECT 127.0.0.1 HTTP/1.1", "no port"),
    (b"CONNECT 127.0.0.1:70000 HTTP/1.1", "port out of range"),
    (b"CONNECT 127.0.0.1:1 HTTP/1.1", "refused inside the namespace"),
])
def test_what_cannot_be_tunnelled_gets_a_502(lab_ns, tmp_path, request_line, why):
    proxy = ConnectProxy(str(tmp_path / "cluster.sock"), lab_ns)
    try:
        c, head = _connect(proxy.path, request_line + b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 502 "), (why, head)
        assert c.recv(1) == b"", why  # and the connection ends
        c.close()
    finally:
        proxy.close()


def test_parse_request_names_the_target():
    assert ConnectProxy.parse_request(b"CONNECT 10.244.1.7:9376 HTTP/1.1\r\nHost: x") == ("10.244.1.7", 9376)
    assert ConnectProxy.parse_request(b"CONNECT [fd00:10:244::7]:80 HTTP/1.1") == ("fd00:10:244::7", 80)
    with pytest.raises(ValueError, match="not a CONNECT"):
        ConnectProxy.parse_request(b"POST /x HTTP/1.1")
