"""Client side of lab traffic: one request over TCP or UDP from inside a namespace.

Sockets are created (and TCP connected) inside the namespace, then used from here.
"""
from __future__ import annotations

import http.client
import socket
from typing import Optional

from kxlb.loader.netns import netns


def _connect(kind: int, ns: str, addr: str, port: int, timeout: float) -> socket.socket:
    with netns(ns):
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, kind)
    s.settimeout(timeout)
    s.connect((addr, port))
    return s


def tcp_connect(ns: str, addr: str, port: int, timeout: float = 3.0) -> socket.socket:
    return _connect(socket.SOCK_STREAM, ns, addr, port, timeout)


def udp_connect(ns: str, addr: str, port: int, timeout: float = 3.0) -> socket.socket:
    """A UDP socket of namespace ``ns`` connected to addr:port (it receives ICMP errors)."""
    return _connect(socket.SOCK_DGRAM, ns, addr, port, timeout)


def tcp_exchange(s: socket.socket, line: str = "hello") -> str:
    """Send one line on a connected socket; return the reply line."""
    s.sendall(line.encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("connection closed before the reply")
        buf += chunk
    return buf.decode().rstrip("\n")


def tcp_request(ns: str, addr: str, port: int, line: str = "hello",
                timeout: float = 3.0) -> tuple[str, tuple[str, int]]:
    """New connection, one line; returns (reply, address the reply came from)."""
    with tcp_connect(ns, addr, port, timeout) as s:
        return tcp_exchange(s, line), s.getpeername()[:2]  # IPv6 adds flow info and scope


def backends_answering(ns: str, addr: str, port: int, want: set[str], tries: int = 60) -> set[str]:
    """The first word of each reply (a lab backend's name) over new TCP connections, until
    every name in ``want`` answered or ``tries`` connections were made. Flows are hashed,
    not dealt round-robin: 12 connections miss one of 3 backends 2% of the time, 60 only
    with odds 3 x (2/3)^60 (1e-10), and a healthy spread stops after a handful."""
    seen: set[str] = set()
    for _ in range(tries):
        seen.add(tcp_request(ns, addr, port, "x")[0].split()[0])
        if want <= seen:
            break
    return seen


def udp_request(ns: str, addr: str, port: int, data: str = "hello", timeout: float = 3.0) -> tuple[str, tuple[str, int]]:
    """One datagram from a fresh (unconnected) socket; returns (reply, its source)."""
    with netns(ns):
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.settimeout(timeout)
        s.sendto(data.encode(), (addr, port))
        reply, src = s.recvfrom(4096)
        return reply.decode(), src[:2]


def http_get(host: str, port: int, path: str, ns: Optional[str] = None, timeout: float = 3) -> tuple[int, str]:
    """GET over a socket made in network namespace *ns*; (status, body)."""
    with netns(ns):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        conn = http.client.HTTPConnection(f"[{host}]" if ":" in host else host, port, timeout=timeout)
        conn.sock = s
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read(4096).decode(errors="replace")
    finally:
        s.close()
