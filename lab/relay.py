"""TCP relays between the lab's network namespaces and the host's loopback.

The lab's control plane serves on the host's loopback, and the nodes live in network
namespaces with no route to the host (``lab/nodes.py``: lab traffic cannot leave). Two
kinds of connection still have to cross, as they would between machines:

- a node's host-network processes to the API server: ``127.0.0.1:<api port>`` inside
  the node's namespace -> the host's ``127.0.0.1:<api port>`` (the pod agent runs one
  such relay; a real-kubelet node one per node);
- the API server to a kubelet (``exec``, ``logs``, ``port-forward``, ``proxy``): the
  API server dials the Node's InternalIP. That address is also a local address on the
  control plane's own interface in the host (a dummy: nothing is sent through it), so
  the dial lands on a relay listening there, which connects to the kubelet inside the
  node's namespace.

A relay is a listening socket made inside one namespace and an outgoing socket made
inside another (a socket keeps the namespace it was created in), pumped by two
threads per connection. Bytes are relayed unchanged (TLS end to end).

    python -m kxlb.lab.relay --map NS/ADDR:PORT=NS/ADDR:PORT [--map ...]

``-`` as NS is the relay's own namespace.
"""
from __future__ import annotations

import argparse
import logging
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


class TcpRelay:
    """Accept on *listen*, connect to *target* for each connection, pump both ways."""

    def __init__(self, listen: Endpoint, target: Endpoint, connect_timeout: float = 5.0):
        self.listen, self.target, self.connect_timeout = listen, target, connect_timeout
        self.sock = listen.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((listen.host, listen.port))
        self.sock.listen(256)
        threading.Thread(target=self._accept, daemon=True, name=f"relay {listen}").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                up = self.target.socket()
                up.settimeout(self.connect_timeout)
                up.connect((self.target.host, self.target.port))
                up.settimeout(None)
            except OSError as exc:
                log.debug("relay %s -> %s: %s", self.listen, self.target, exc)
                conn.close()
                continue
            state = {"open": 2}
            lock = threading.Lock()
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b, conn, up, state, lock), daemon=True).start()

    @staticmethod
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

    def close(self) -> None:
        self.sock.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--map", action="append", required=True, metavar="NS/ADDR:PORT=NS/ADDR:PORT",
                    help="listen on the left, connect to the right (NS '-': this namespace)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    relays = []
    for m in a.map:
        left, eq, right = m.partition("=")
        try:
            if not eq:
                raise ValueError(f"bad --map {m!r}: want LISTEN=TARGET")
            relays.append(TcpRelay(Endpoint.parse(left), Endpoint.parse(right)))
        except (ValueError, OSError) as exc:
            print(f"relay: {m}: {exc}", file=sys.stderr)
            return 2
        log.info("relaying %s -> %s", left, right)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
