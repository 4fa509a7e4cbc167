"""The lab's workload: a TCP and UDP echo server that answers with its own name.

TCP: for every line received, send back "NAME LINE". UDP: for every datagram, send back
"NAME DATAGRAM". Run as ``python -m kxlb.lab.echo --name N --port P [--netns NS]``.
"""
from __future__ import annotations

import argparse
import socket
import socketserver
import threading

from kxlb.loader.netns import netns


def make_servers(name: str, port: int, host: str = "0.0.0.0") -> list[socketserver.BaseServer]:
    tag = name.encode()

    class TcpHandler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(tag + b" " + line)
                self.wfile.flush()

    class UdpHandler(socketserver.BaseRequestHandler):  # one reply, no empty trailer
        def handle(self) -> None:
            data, sock = self.request
            sock.sendto(tag + b" " + data, self.client_address)

    class Tcp(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    return [Tcp((host, port), TcpHandler), socketserver.ThreadingUDPServer((host, port), UdpHandler)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    ap.add_argument("--netns", help="network namespace to serve in")
    a = ap.parse_args(argv)
    with netns(a.netns):  # sockets keep the namespace they were made in
        servers = [s for p in a.port for s in make_servers(a.name, p)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    print("ready", flush=True)
    threads[0].join()


if __name__ == "__main__":
    main()
