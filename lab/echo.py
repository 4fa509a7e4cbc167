"""The lab's workload: echo servers that answer with their own name.

TCP: for every line received, send back "NAME LINE". UDP: for every datagram, send back
"NAME DATAGRAM". HTTP: any GET (or HEAD) gets status 200 and the body "NAME" (no
newline), with ``Content-Type: text/plain``; POST gets "NAME " followed by its body.
Asking "clientip" (a TCP line, a UDP datagram, or HTTP GET /clientip, as agnhost's
netexec does) answers with the client's address as this server saw it, "NAME IP:PORT"
(HTTP: "IP:PORT"), so a test can tell a masqueraded client from a preserved one.

    python -m kxlb.lab.echo --name N [--netns NS] [--port P] [--tcp P] [--udp P] [--http P] [--ipv6]

``--port`` serves TCP and UDP on P; ``--tcp``, ``--udp`` and ``--http`` one protocol
each (all repeatable). ``--ipv6``: every server also listens on IPv6 (a socket of its
own, IPV6_V6ONLY, so IPv4 clients keep showing plain IPv4 addresses). "ready" is printed
on stdout once every socket is bound.
"""
from __future__ import annotations

import argparse
import http.server
import signal
import socket
import socketserver
import sys
import threading

from kxlb.loader.netns import netns


class _Tcp(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024


class _Udp(socketserver.ThreadingUDPServer):
    allow_reuse_address = True
    daemon_threads = True


class _Http(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024


CLIENTIP = b"clientip"


def _peer(addr: tuple) -> bytes:
    return f"{addr[0]}:{addr[1]}".encode()


def make_tcp_server(name: str, port: int, host: str = "0.0.0.0") -> socketserver.BaseServer:
    tag = name.encode()

    class TcpHandler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            try:
                for line in self.rfile:
                    if line.strip() == CLIENTIP:
                        line = _peer(self.client_address) + b"\n"
                    self.wfile.write(tag + b" " + line)
                    self.wfile.flush()
            except ConnectionError:
                pass

    return _Tcp((host, port), TcpHandler)


def make_udp_server(name: str, port: int, host: str = "0.0.0.0") -> socketserver.BaseServer:
    tag = name.encode()

    class UdpHandler(socketserver.BaseRequestHandler):  # one reply, no empty trailer
        def handle(self) -> None:
            data, sock = self.request
            if data.strip() == CLIENTIP:
                data = _peer(self.client_address)
            sock.sendto(tag + b" " + data, self.client_address)

    return _Udp((host, port), UdpHandler)


def make_http_server(name: str, port: int, host: str = "0.0.0.0") -> socketserver.BaseServer:
    body = name.encode()

    class HttpHandler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, as real servers do
        server_version = "kxlab-echo"

        def _reply(self, payload: bytes, head: bool = False) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if not head:
                self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(_peer(self.client_address) if self.path == "/clientip" else body)

        def do_HEAD(self) -> None:  # noqa: N802
            self._reply(body, head=True)

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length") or 0)
            self._reply(body + b" " + self.rfile.read(n))

        def log_message(self, *args) -> None:  # quiet
            pass

    return _Http((host, port), HttpHandler)


def _on_ipv6(server_cls: type) -> type:
    """The server class listening on an IPv6 address only (IPV6_V6ONLY)."""
    class V6(server_cls):
        address_family = socket.AF_INET6

        def server_bind(self) -> None:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            super().server_bind()
    return V6


_V6_CLASSES = {cls: _on_ipv6(cls) for cls in (_Tcp, _Udp, _Http)}


def on_ipv6(server: socketserver.BaseServer) -> socketserver.BaseServer:
    """The same server (handler and port) again, on "::"."""
    cls = _V6_CLASSES[next(c for c in _V6_CLASSES if isinstance(server, c))]
    return cls(("::", server.server_address[1]), server.RequestHandlerClass)


def make_servers(name: str, port: int, host: str = "0.0.0.0") -> list[socketserver.BaseServer]:
    """TCP and UDP echo on the same port."""
    return [make_tcp_server(name, port, host), make_udp_server(name, port, host)]


def serve(servers: list[socketserver.BaseServer]) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    return threads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, action="append", default=[], help="TCP and UDP (repeatable)")
    ap.add_argument("--tcp", type=int, action="append", default=[], help="TCP echo (repeatable)")
    ap.add_argument("--udp", type=int, action="append", default=[], help="UDP echo (repeatable)")
    ap.add_argument("--http", type=int, action="append", default=[], help="HTTP (repeatable)")
    ap.add_argument("--netns", help="network namespace to serve in")
    ap.add_argument("--ipv6", action="store_true", help="also serve every port on IPv6")
    a = ap.parse_args(argv)
    if not (a.port or a.tcp or a.udp or a.http):
        ap.error("no port to serve")
    with netns(a.netns):  # sockets keep the namespace they were made in
        servers = [s for p in a.port for s in make_servers(a.name, p)]
        servers += [make_tcp_server(a.name, p) for p in a.tcp]
        servers += [make_udp_server(a.name, p) for p in a.udp]
        servers += [make_http_server(a.name, p) for p in a.http]
        if a.ipv6:
            servers += [on_ipv6(s) for s in list(servers)]
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    serve(servers)
    print("ready", flush=True)
    try:
        sys.stdout.close()  # nothing more to say: a reader that goes away cannot hurt us
    except OSError:
        pass
    done.wait()


if __name__ == "__main__":
    main()
