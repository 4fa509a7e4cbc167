"""The one HTTP server of the controller's listeners: the health port (10256), the
metrics port (10249) and the healthCheckNodePorts. Load balancers and whoever can reach
the node talk to them, so a hostile client must neither grow the process nor keep the
probes from being answered.

Why one event loop (stdlib selectors) for every listener of the process, rather than a
thread per connection (http.server: 6,000 idle connections made 6,000 threads) or a
bounded thread pool (N slow clients would hold all N threads): an idle or trickling
connection costs a socket and a few hundred bytes, never a thread; the connection budget
is the process's, so a flood on one port cannot take the slots another port's probes
need; and every handler is short (a health answer, a metrics render), so running them on
the loop thread is cheaper than handing them over.

Limits, per process (docs/controller.md, *HTTP servers*):
- at most MAX_CONNECTIONS client connections over all listeners. One more is accepted and
  the connection that has waited longest (for a request, or for its response to be read)
  is closed to make room: a flood only displaces itself, while a probe, whose request
  follows its connect at once, is served. (Refusing the newest instead would let whoever
  holds the slots lock the load balancers out until their connections time out.)
- a request head must be complete HEAD_TIMEOUT after the connection is accepted, or
  after its first byte on a kept-alive connection: a total deadline, so a client sending
  a byte every few seconds is cut off too; at most MAX_HEAD bytes (431 beyond);
- a kept-alive connection is closed after IDLE_TIMEOUT without a new request, a
  response not read within WRITE_TIMEOUT is abandoned;
- listen backlog: the kernel's net.core.somaxconn, as Go's listeners (not http.server's 5).

HTTP/1.1 with keep-alive (HTTP/1.0: one request a connection), every response with
Content-Length. GET and HEAD (the same answer without its body) only, 405 otherwise:
every endpoint here is a read, and a request body is never read (the connection closes
after a request with one). Handlers are functions of the path (query string removed)
returning (status, headers, body); they run on the loop thread, so they must be quick.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import queue
import re
import selectors
import socket
import threading
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Callable

log = logging.getLogger("kxlb.http")

Handler = Callable[[str], tuple[int, dict[str, str], bytes]]

MAX_CONNECTIONS = 512     # a few probes and scrapes at a time; well inside a 1024-file limit
HEAD_TIMEOUT = 5.0        # seconds: probes come over the node's network, answered in ms
IDLE_TIMEOUT = 5.0        # Prometheus scrapes every 15-30 s: a new connection per scrape
WRITE_TIMEOUT = 10.0
LINGER = 1.0              # after a last response: read and drop what the client still sends
MAX_HEAD = 8192
BACKLOG = 65535           # the kernel caps it at net.core.somaxconn: what Go asks for
SWEEP = 0.25              # deadlines are checked this often
ACCEPT_BATCH = 16         # accepts per wake-up: a connect flood still lets requests through

TEXT = {"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"}
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def listen_socket(host: str, port: int, family_only: bool = False) -> socket.socket:
    """A listening TCP socket on ``host`` (an IP address) and ``port``, in the calling
    thread's network namespace. A wildcard host ("", 0.0.0.0 or ::) is every address of
    both families, [::] with IPV6_V6ONLY off, as Go's net.Listen("tcp", "0.0.0.0:10256")
    in kube-proxy; IPv4 alone where the kernel has no IPv6. ``family_only``: the wildcard
    of the host's own family alone (Go's "tcp4"/"tcp6", as kube-proxy's per-family
    health check servers listen)."""
    ip = ipaddress.ip_address(host or "::")
    if not ip.is_unspecified or family_only:
        return _listening(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip), port,
                          v6only=ip.version == 6)
    try:
        return _listening(socket.AF_INET6, "::", port, dual_stack=True)
    except OSError as exc:
        if exc.errno != errno.EAFNOSUPPORT:
            raise
        return _listening(socket.AF_INET, "0.0.0.0", port)


def _listening(family: int, host: str, port: int, dual_stack: bool = False, v6only: bool = False) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart rebinds past TIME_WAIT
        if dual_stack or v6only:  # whatever net.ipv6.bindv6only says
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        s.bind((host, port))
        s.listen(BACKLOG)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


class Server:
    """One listener, served by the process's loop thread until close()."""

    def __init__(self, host: str, port: int, handler: Handler, name: str = "http", family_only: bool = False):
        self.handler, self.name = handler, name
        self.sock = listen_socket(host, port, family_only)  # here: the caller may be inside a netns
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        loop = _loop()
        loop.call(lambda: loop.add(self))

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        """Stop listening and close this listener's connections; the port is free when
        this returns. Not to be called holding a lock a handler takes."""
        loop = _loop()
        loop.call(lambda: loop.remove(self))

    def respond(self, head: bytes) -> tuple[bytes, bool]:
        """The response to one request head, and whether the connection stays open."""
        lines = head.decode("latin-1").splitlines()
        request = lines[0].split() if lines else []
        if len(request) != 3 or request[2] not in ("HTTP/1.0", "HTTP/1.1"):
            return _response(400, TEXT, b"bad request\n", keep=False), False
        method, target, version = request
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        # HTTP/1.0 clients get one answer a connection (no Connection: keep-alive dance).
        keep = version == "HTTP/1.1" and "close" not in {t.strip().lower() for t in
                                                         fields.get("connection", "").split(",")}
        if fields.get("content-length", "0") != "0" or "transfer-encoding" in fields:
            keep = False  # its body is not read: what follows is not a request boundary
        if method not in ("GET", "HEAD"):
            return _response(405, {**TEXT, "Allow": "GET, HEAD"}, b"method not allowed\n", keep), keep
        try:
            status, headers, body = self.handler(target.split("?", 1)[0])
        except Exception:
            log.exception("%s: answering %s", self.name, target)
            status, headers, body = 500, TEXT, b"internal error\n"
        return _response(status, headers, body, keep, with_body=method == "GET"), keep


def _response(status: int, headers: dict[str, str], body: bytes, keep: bool, with_body: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Date: {formatdate(usegmt=True)}",
             *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {len(body)}"]
    if not keep:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if with_body else b"")


class _Conn:
    __slots__ = ("sock", "server", "deadline", "buf", "out", "keep", "idle", "writing", "draining")

    def __init__(self, sock: socket.socket, server: Server, deadline: float):
        self.sock, self.server, self.deadline = sock, server, deadline
        self.buf = self.out = b""
        self.keep = self.idle = self.writing = self.draining = False


class _Loop:
    """The process's one HTTP thread: every listener and client connection."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.servers: set[Server] = set()
        self.paused: set[Server] = set()   # out of file descriptors: not accepting for a sweep
        self.conns: dict[_Conn, None] = {}  # oldest first (last state change): who is evicted
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="http-servers", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread and wait for it: selectors are not thread-safe."""
        if threading.current_thread() is self.thread:
            fn()
            return
        done = threading.Event()
        self._calls.put((fn, done))
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the loop has wake-ups pending already
        done.wait()

    def add(self, server: Server) -> None:
        self.servers.add(server)
        self.sel.register(server.sock, selectors.EVENT_READ, server)

    def remove(self, server: Server) -> None:
        if server not in self.servers:
            return
        self.servers.discard(server)
        if server in self.paused:
            self.paused.discard(server)
        else:
            self.sel.unregister(server.sock)
        server.sock.close()
        for c in [c for c in self.conns if c.server is server]:
            self._close(c)

    def _run(self) -> None:
        next_sweep = 0.0
        while True:
            for key, mask in self.sel.select(SWEEP):
                try:
                    self._event(key.data, mask)
                except Exception:  # the loop serves every listener: it must not die
                    log.exception("HTTP server loop")
                    if isinstance(key.data, _Conn):
                        self._close(key.data)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + SWEEP

    def _event(self, data, mask: int) -> None:
        if data is None:
            self._run_calls()
        elif isinstance(data, Server):
            if data in self.servers:  # not removed earlier in this round
                self._accept(data)
        elif data in self.conns:      # not closed earlier in this round
            if mask & selectors.EVENT_WRITE:
                self._write(data)
                self._serve(data)  # a pipelined request may wait in the buffer
            else:
                self._read(data)

    def _run_calls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("HTTP server loop")
            finally:
                done.set()

    def _sweep(self, now: float) -> None:
        for c in [c for c in self.conns if c.deadline <= now]:
            self._close(c)
        for server in self.paused:
            self.sel.register(server.sock, selectors.EVENT_READ, server)
        self.paused.clear()

    def _accept(self, server: Server) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = server.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of file descriptors (the listener would stay readable: a busy
                    # loop): free one of ours, or stop accepting until the next sweep.
                    if self.conns:
                        self._close(next(iter(self.conns)))
                    else:
                        self.sel.unregister(server.sock)
                        self.paused.add(server)
                return  # else (ECONNABORTED...): that client is gone already
            if len(self.conns) >= MAX_CONNECTIONS:
                self._close(next(iter(self.conns)))
            sock.setblocking(False)
            c = _Conn(sock, server, time.monotonic() + HEAD_TIMEOUT)
            self.conns[c] = None
            self.sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(c)
            return
        if c.draining:
            return
        if c.idle:  # a kept-alive connection's next request begins: its head's deadline
            c.idle, c.deadline = False, time.monotonic() + HEAD_TIMEOUT
        c.buf += data
        self._serve(c)

    def _serve(self, c: _Conn) -> None:
        """Answer the requests the buffer holds whole, one at a time (pipelining), while
        each answer goes out at once."""
        while c in self.conns and not c.out and not c.draining:
            m = _HEAD_END.search(c.buf)
            if m is None and len(c.buf) <= MAX_HEAD:
                return  # more to come
            if m is None or m.start() > MAX_HEAD:
                c.buf, c.out, c.keep = b"", _response(431, TEXT, b"request head too large\n", False), False
            else:
                head, c.buf = c.buf[:m.start()], c.buf[m.end():]
                c.out, c.keep = c.server.respond(head)
            c.deadline = time.monotonic() + WRITE_TIMEOUT
            self._touch(c)
            self._write(c)  # most answers fit the socket buffer at once

    def _write(self, c: _Conn) -> None:
        try:
            sent = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(c)
            return
        c.out = c.out[sent:]
        if c.out:
            if not c.writing:
                c.writing = True
                self.sel.modify(c.sock, selectors.EVENT_WRITE, c)
            return
        if c.writing:
            c.writing = False
            self.sel.modify(c.sock, selectors.EVENT_READ, c)
        if not c.keep:  # half-close, then drop what the client still sends (closing with
            c.draining, c.buf = True, b""  # unread data would reset the response away)
            c.deadline = time.monotonic() + LINGER
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(c)
            return
        c.idle = not c.buf
        c.deadline = time.monotonic() + (IDLE_TIMEOUT if c.idle else HEAD_TIMEOUT)
        self._touch(c)

    def _touch(self, c: _Conn) -> None:
        del self.conns[c]  # to the end of the eviction order
        self.conns[c] = None

    def _close(self, c: _Conn) -> None:
        if c in self.conns:
            del self.conns[c]
            self.sel.unregister(c.sock)
            c.sock.close()


_the_loop: _Loop | None = None
_the_loop_lock = threading.Lock()


def _loop() -> _Loop:
    global _the_loop
    with _the_loop_lock:
        if _the_loop is None:
            _the_loop = _Loop()
        return _the_loop
