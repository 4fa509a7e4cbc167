"""TCP relays between the lab's network namespaces and the host's loopback.

The lab's control plane serves on the host's loopback, and the nodes live in network
namespaces with no route to the host (``lab/nodes.py``: lab traffic cannot leave). Two
kinds of connection still have to cross, as they would between machines:

- a node's host-network processes to the API server: ``127.0.0.1:<api port>`` inside
  the node's namespace -> the host's ``127.0.0.1:<api port>`` (the pod agent runs one
  such relay; a real-kubelet node one per node);
- the API server to the cluster: a kubelet (``exec``, ``logs``, ``port-forward``) or a
  pod (the ``pods/proxy`` and ``services/proxy`` subresources). The API server's
  egress selector sends its "cluster" traffic as HTTP CONNECT over a unix socket (as it
  would to a konnectivity server); the relay answers it by dialing the target from
  inside a node's namespace, which routes to every node and pod.

A relay is a listening socket made inside one namespace and an outgoing socket made
inside another (a socket keeps the namespace it was created in), pumped by two
threads per connection. Bytes are relayed unchanged (TLS end to end).

    python -m kxlb.lab.relay [--map NS/ADDR:PORT=NS/ADDR:PORT ...] [--connect SOCKET=NS ...]

``-`` as NS is the relay's own namespace.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from kxlb.loader.netns import netns

log = logging.getLogger("kxlab.relay")


@dataclass(frozen=True)
class Endpoint:
    netns: Optional[str]   # None: this process's namespace
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        """``NS/ADDR:PORT`` (NS ``-``: our own namespace)."""
        ns, sep, rest = text.partition("/")
        host, colon, port = rest.rpartition(":")
        if not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad relay endpoint {text!r}: want NS/ADDR:PORT")
        return cls(None if ns == "-" else ns, host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.netns or '-'}/{self.host}:{self.port}"

    def socket(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with netns(self.netns):
            return socket.socket(family, socket.SOCK_STREAM)


def dial(target: Endpoint, timeout: float) -> socket.socket:
    """A TCP connection to *target*, made inside its namespace."""
    up = target.socket()
    try:
        up.settimeout(timeout)
        up.connect((target.host, target.port))
        up.settimeout(None)
    except OSError:
        up.close()
        raise
    return up


class _Server:
    """Accept on ``self.sock`` until it closes; serve each connection in its own thread
    (a slow dial holds up nobody else)."""

    sock: socket.socket

    def _start(self, name: str) -> None:
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class TcpRelay(_Server):
    """Accept on *listen*, connect to *target* for each connection, pump both ways."""

    def __init__(self, listen: Endpoint, target: Endpoint, connect_timeout: float = 5.0):
        self.listen, self.target, self.connect_timeout = listen, target, connect_timeout
        self.sock = listen.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((listen.host, listen.port))
        self.sock.listen(256)
        self._start(f"relay {listen}")

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = dial(self.target, self.connect_timeout)
        except OSError as exc:
            log.debug("relay %s -> %s: %s", self.listen, self.target, exc)
            conn.close()
            return
        splice(conn, up)


class ConnectProxy(_Server):
    """An HTTP CONNECT proxy on a unix socket that dials from inside namespace *netns*:
    the API server's egress for "cluster" traffic (EgressSelectorConfiguration,
    proxyProtocol HTTPConnect, transport uds). One request per connection: the
    ``CONNECT host:port`` line, headers, an empty line; then the tunnel."""

    MAX_HEADER = 16384

    def __init__(self, path: str, netns: Optional[str], connect_timeout: float = 5.0):
        self.path, self.netns, self.connect_timeout = path, netns, connect_timeout
        try:
            os.unlink(path)  # a stale socket of a crashed relay
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(256)
        self._start(f"connect {path}")

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.connect_timeout)
        try:
            head, rest = self._read_head(conn)
            up = dial(Endpoint(self.netns, *self.parse_request(head)), self.connect_timeout)
        except (OSError, ValueError) as exc:
            log.info("CONNECT refused (%s)", exc)
            try:
                conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            conn.close()
            return
        conn.settimeout(None)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            up.sendall(rest)
        splice(conn, up)

    def _read_head(self, conn: socket.socket) -> tuple[bytes, bytes]:
        buf = b""
        while b"\r\n\r\n" not in buf:
            if len(buf) > self.MAX_HEADER:
                raise ValueError("request header too long")
            data = conn.recv(4096)
            if not data:
                raise ValueError("closed before the end of the request")
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        return head, rest

    @staticmethod
    def parse_request(head: bytes) -> tuple[str, int]:
        """(host, port) of a ``CONNECT host:port HTTP/1.x`` request; ValueError otherwise."""
        line = head.split(b"\r\n", 1)[0].decode("ascii", "replace")
        parts = line.split()
        if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
            raise ValueError(f"not a CONNECT request: {line!r}")
        host, colon, port = parts[1].rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise ValueError(f"bad CONNECT target {parts[1]!r}")
        return host.strip("[]"), int(port)


def splice(c1: socket.socket, c2: socket.socket) -> None:
    """Pump bytes both ways between two connected sockets, one thread per direction;
    both close when both directions are done."""
    state = {"open": 2}
    lock = threading.Lock()
    for a, b in ((c1, c2), (c2, c1)):
        threading.Thread(target=_pump, args=(a, b, c1, c2, state, lock), daemon=True).start()


def _pump(src, dst, c1, c2, state, lock) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (c1, c2):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    with lock:
        state["open"] -= 1
        last = state["open"] == 0
    if last:
        c1.close()
        c2.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--map", action="append", default=[], metavar="NS/ADDR:PORT=NS/ADDR:PORT",
                    help="listen on the left, connect to the right (NS '-': this namespace)")
    ap.add_argument("--connect", action="append", default=[], metavar="SOCKET=NS",
                    help="an HTTP CONNECT proxy on unix socket SOCKET that dials from namespace NS")
    a = ap.parse_args(argv)
    if not a.map and not a.connect:
        ap.error("nothing to relay: give --map or --connect")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    relays: list = []
    for opt, m in [("--map", m) for m in a.map] + [("--connect", m) for m in a.connect]:
        left, eq, right = m.partition("=")
        try:
            if not eq or not left or not right:
                raise ValueError(f"bad {opt} {m!r}: want " + ("LISTEN=TARGET" if opt == "--map" else "SOCKET=NS"))
            if opt == "--map":
                relays.append(TcpRelay(Endpoint.parse(left), Endpoint.parse(right)))
            else:
                relays.append(ConnectProxy(left, None if right == "-" else right))
        except (ValueError, OSError) as exc:
            print(f"relay: {m}: {exc}", file=sys.stderr)
            return 2
        log.info("relaying %s -> %s%s", left, right, " (HTTP CONNECT)" if opt == "--connect" else "")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
