"""Socket-level translation (bpf/sock.c) for host-network processes, with real sockets:
processes run in a cgroup that has the hooks and in the lab node's network namespace,
and reach the echo servers of the backend namespaces (each reply starts with the
backend's name). Also the teardown of connected UDP sockets whose backend was removed
(controller/socks.py over loader/sockdiag.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kxlb.controller.socks import UdpSocketReaper
from kxlb.lab.netlab import NetLab

PORT = 8080  # the echo servers' TCP and UDP port

# Run in the child: helpers every snippet below uses. fam "v4": AF_INET; "v6": a
# dual-stack AF_INET6 socket (IPV6_V6ONLY off, as Java and Go make them) addressing
# IPv4 as ::ffff:a.b.c.d.
PRELUDE = r'''
import errno, json, socket, sys, threading
def mk(fam, kind):
    if fam == "v4":
        return socket.socket(socket.AF_INET, kind)
    s = socket.socket(socket.AF_INET6, kind)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    return s
def addr(fam, ip, port):
    return (ip, port) if fam == "v4" or ":" in ip else ("::ffff:" + ip, port)
def err(e):
    return errno.errorcode.get(e.errno, str(e))
def out(obj):
    print(json.dumps(obj), flush=True)
'''


class HostLab:
    """The netns lab's node with the datapath's maps, the socket hooks attached to a
    cgroup of its own, and no tc/XDP programs: host processes only."""

    def __init__(self, lab: NetLab):
        self.lab = lab
        self.pin_dir = lab.pin_dir
        self.cgroup = f"/sys/fs/cgroup/unified/{lab.tag}"

    def kxlb(self, *args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", self.pin_dir, *args],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    def be(self, i: int) -> str:
        return f"{self.lab.backend_ip(i)}:{PORT}"

    def _argv(self, code: str, args) -> list[str]:
        # Into the cgroup first (`ip netns exec` remounts /sys), then the node's netns.
        return ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec ip netns exec {self.lab.node} '
                f'{sys.executable} -c "$0" "$@"', PRELUDE + code, *map(str, args)]

    def run(self, code: str, *args) -> list:
        """Run ``code`` as a host process; returns the JSON lines it printed."""
        r = subprocess.run(self._argv(code, args), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]

    def spawn(self, code: str, *args) -> subprocess.Popen:
        return subprocess.Popen(self._argv(code, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def host():
    from kxlb.loader.compile import compile_datapath
    from kxlb.loader.socklb import attach_socket_lb

    with NetLab() as lab:
        lab.start_servers(PORT)
        h = HostLab(lab)
        os.makedirs(h.cgroup)
        try:
            compile_datapath(lab.pin_dir)  # as the controller does: the maps, then the hooks
            attach_socket_lb(lab.pin_dir, h.cgroup)
            yield h
        finally:
            os.rmdir(h.cgroup)  # detaches the hooks


def test_all_eight_hooks_are_attached(host):
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", host.cgroup], capture_output=True, text=True).stdout
    got = {p["attach_type"]: p["name"] for p in json.loads(out)}
    assert got == {f"cgroup_{t}": f"kxlb_{h}" for t, h in
                   [("inet4_connect", "connect4"), ("udp4_sendmsg", "sendmsg4"), ("udp4_recvmsg", "recvmsg4"),
                    ("inet4_getpeername", "getpeername4"), ("inet6_connect", "connect6"),
                    ("udp6_sendmsg", "sendmsg6"), ("udp6_recvmsg", "recvmsg6"),
                    ("inet6_getpeername", "getpeername6")]}


@pytest.mark.parametrize("fam", ["v4", "v6", "ipv6-service"])
def test_sockets_reach_every_backend_and_see_the_vip(host, fam):
    """TCP connect, connected UDP and unconnected UDP sendto/recvfrom, from AF_INET and
    from dual-stack AF_INET6 sockets to an IPv4 service, and from AF_INET6 sockets to an
    IPv6 service: translated to backends (all three over 24 sockets of each kind), and
    the VIP is what getpeername() and recvfrom() show."""
    vip = {"v4": "10.96.7.1", "v6": "10.96.7.2", "ipv6-service": "fd00:96::7:3"}[fam]
    if fam == "ipv6-service":
        fam, backends, front = "v6", [f"[{host.lab.backend_ip6(i)}]:{PORT}" for i in range(3)], f"[{vip}]"
    else:
        backends, front = [host.be(i) for i in range(3)], vip
    host.kxlb("service", "add", f"{front}:80/tcp", *backends)
    host.kxlb("service", "add", f"{front}:53/udp", *backends)
    code = r'''
fam, vip = sys.argv[1], sys.argv[2]
for _ in range(24):
    t = mk(fam, socket.SOCK_STREAM); t.settimeout(3); t.connect(addr(fam, vip, 80)); t.sendall(b"t\n")
    out(["tcp", t.recv(100).decode().split()[0], list(t.getpeername()[:2])]); t.close()
    u = mk(fam, socket.SOCK_DGRAM); u.settimeout(3); u.connect(addr(fam, vip, 53)); u.send(b"u")
    out(["udp", u.recv(100).decode().split()[0], list(u.getpeername()[:2])]); u.close()
    d = mk(fam, socket.SOCK_DGRAM); d.settimeout(3); d.sendto(b"d", addr(fam, vip, 53))
    data, src = d.recvfrom(100)
    out(["sendto", data.decode().split()[0], list(src[:2])]); d.close()
'''
    rows = host.run(code, fam, vip)
    want_peer = {"tcp": [vip if fam == "v4" or ":" in vip else "::ffff:" + vip, 80]}
    want_peer["udp"] = want_peer["sendto"] = [want_peer["tcp"][0], 53]
    for kind in ("tcp", "udp", "sendto"):
        got = [r for r in rows if r[0] == kind]
        assert len(got) == 24
        assert {r[1] for r in got} == {"be0", "be1", "be2"}, kind
        assert all(r[2] == want_peer[kind] for r in got), (kind, got)


def test_pure_ipv6_addresses_are_passed_untouched(host):
    """Only ::ffff:0:0/96 is an IPv4 service's: an IPv6 address whose last 32 bits spell
    a VIP (and that is no IPv6 service) is not translated (no route: the connect fails as it would without kxlb), and a plain
    IPv6 connection on the node works."""
    host.kxlb("service", "add", "10.96.7.3:53/udp", host.be(0))
    code = r'''
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
try: u.connect(("2001:db8::10.96.7.3", 53)); out("connected")
except OSError as e: out(err(e))
srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM); srv.bind(("::1", 0)); srv.listen()
c = socket.create_connection(("::1", srv.getsockname()[1]), timeout=3)
out(list(c.getpeername()[:2]) == ["::1", srv.getsockname()[1]])
'''
    assert host.run(code) == ["ENETUNREACH", True]


def test_a_service_without_endpoints_refuses_at_once(host):
    """kube-proxy rejects: connect() fails with ECONNREFUSED (not the hook's EPERM), for
    TCP and connected UDP, AF_INET and IPv4-mapped alike."""
    vip = "10.96.7.4"
    host.kxlb("service", "add", f"{vip}:80/tcp")
    host.kxlb("service", "add", f"{vip}:53/udp")
    code = r'''
vip = sys.argv[1]
for fam in ("v4", "v6"):
    for kind, port in ((socket.SOCK_STREAM, 80), (socket.SOCK_DGRAM, 53)):
        s = mk(fam, kind); s.settimeout(5)
        try: s.connect(addr(fam, vip, port)); out("connected")
        except OSError as e: out(err(e))
'''
    t0 = time.monotonic()
    assert host.run(code, vip) == ["ECONNREFUSED"] * 4
    assert time.monotonic() - t0 < 4  # at once, not after a timeout


TWO_QUERIES = r'''
# One unconnected socket, two queries in flight (to VIP a, then VIP b), then both
# replies: each must come from the VIP its query went to.
fam, a, b, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for i in range(n):
    s = mk(fam, socket.SOCK_DGRAM); s.settimeout(3)
    s.sendto(b"qa", addr(fam, a, 53)); s.sendto(b"qb", addr(fam, b, 53))
    got = {}
    for _ in range(2):
        data, src = s.recvfrom(100)
        name, q = data.decode().split()
        got[q] = [name, src[0].removeprefix("::ffff:")]
    out(got); s.close()
'''


@pytest.mark.parametrize("fam", ["v4", "v6", "ipv6-service"])
def test_one_socket_two_vips_sharing_a_backend_get_replies_from_the_right_vip(host, fam):
    """sock_rev is keyed (socket, backend): VIP a's only backend be0 is also one of VIP
    b's. A socket that already uses be0 for a gets another backend of b (be1), so each
    reply shows its own VIP. Without that, half the sockets would hash b to be0 and see
    qa's reply come from b. The same for IPv6 services (sock_rev6)."""
    if fam == "ipv6-service":
        a, b = "fd00:96::7:5", "fd00:96::7:6"
        be = [f"[{host.lab.backend_ip6(i)}]:{PORT}" for i in range(2)]
        host.kxlb("service", "add", f"[{a}]:53/udp", be[0])
        host.kxlb("service", "add", f"[{b}]:53/udp", *be)
        fam = "v6"
    else:
        a, b = ("10.96.7.5", "10.96.7.6") if fam == "v4" else ("10.96.7.7", "10.96.7.8")
        host.kxlb("service", "add", f"{a}:53/udp", host.be(0))
        host.kxlb("service", "add", f"{b}:53/udp", host.be(0), host.be(1))
    rows = host.run(TWO_QUERIES, fam, a, b, 16)
    assert len(rows) == 16
    for got in rows:
        assert got == {"qa": ["be0", a], "qb": ["be1", b]}, rows


def test_two_vips_whose_only_backend_is_shared_last_one_wins(host):
    """No other backend to choose: the documented fallback (bpf/sock.c,
    sock_pick_unshared()) keeps the backend and the newest VIP's entry, so a socket
    that alternates between the two VIPs gets each reply right, and only a reply still
    in flight for the older VIP is shown as the newer one."""
    a, b = "10.96.7.9", "10.96.7.10"
    host.kxlb("service", "add", f"{a}:53/udp", host.be(2))
    host.kxlb("service", "add", f"{b}:53/udp", host.be(2))
    code = r'''
a, b = sys.argv[1], sys.argv[2]
s = mk("v4", socket.SOCK_DGRAM); s.settimeout(3)
for vip in (a, b, a, b):
    s.sendto(b"q", (vip, 53)); data, src = s.recvfrom(100)
    out([data.decode().split()[0], src[0]])
s.sendto(b"qa", (a, 53)); s.sendto(b"qb", (b, 53))
out(sorted([s.recvfrom(100)[1][0], s.recvfrom(100)[1][0]]))
'''
    assert host.run(code, a, b) == [["be2", a], ["be2", b], ["be2", a], ["be2", b], [b, b]]


# The teardown test's child: connected UDP sockets to the VIP until at least one has
# the backend to be removed and one another; sockets straight to every backend (not
# translated: never ours); one TCP connection through the VIP to the doomed backend.
TEARDOWN_CHILD = r'''
fam, vip, other, doomed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
bes = sys.argv[5:]
def ask(s):
    s.send(b"x"); return s.recv(100).decode().split()[0]
def vip_socket(ip):
    s = mk(fam, socket.SOCK_DGRAM); s.settimeout(3); s.connect(addr(fam, ip, 53)); return s
socks = []
while len(socks) < 64 and not ({n for n, _ in socks} >= {doomed} and any(n != doomed for n, _ in socks)):
    s = vip_socket(vip); socks.append((ask(s), s))
directs = []
for be in bes:
    s = mk(fam, socket.SOCK_DGRAM); s.settimeout(3); s.connect(addr(fam, be, %d)); directs.append((ask(s), s))
o = vip_socket(other); o_name = ask(o)    # another Service, whose only backend is the doomed one
while True:
    t = mk(fam, socket.SOCK_STREAM); t.settimeout(3); t.connect(addr(fam, vip, 80)); t.sendall(b"t\n")
    if t.recv(100).decode().split()[0] == doomed: break
    t.close()
# Every socket on the doomed backend now waits in recv(), as a resolver would.
results = {}
def wait(i, s):
    try: s.settimeout(10); results[i] = "data " + s.recv(100).decode()
    except OSError as e: results[i] = err(e)
waiters = [threading.Thread(target=wait, args=(i, s)) for i, (n, s) in enumerate(socks) if n == doomed]
for w in waiters: w.start()
out({"names": [n for n, _ in socks], "other": o_name})
sys.stdin.readline()                      # the parent removed the backend and reaped
for w in waiters: w.join()
rows = []
for i, (n, s) in enumerate(socks):
    if n == doomed:
        s2 = vip_socket(vip)              # what the application does: connect again
        rows.append([results[i], ask(s2), s2.getpeername()[0].removeprefix("::ffff:")])
    else:
        rows.append(["kept", ask(s), s.getpeername()[0].removeprefix("::ffff:")])
out({"rows": rows, "directs": [[n, ask(s)] for n, s in directs], "other": ask(o),
     "tcp": (t.sendall(b"t\n"), t.recv(100).decode().split()[0])[1]})
''' % PORT


@pytest.mark.parametrize("fam", ["v4", "v6", "ipv6-service"])
def test_connected_udp_sockets_to_a_removed_backend_are_destroyed(host, fam):
    """The backend be0 leaves a UDP service: every connected UDP socket the hooks sent
    there is destroyed (a recv() waiting on it fails with ECONNABORTED at once), and its
    reconnect reaches a serving backend with the VIP as peer. Kept: sockets on serving
    backends, sockets connected straight to a backend address, a socket of a Service
    that was deleted (kube-proxy leaves those), and TCP."""
    from kxlb.controller.conntrack import serving_by_frontend
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.svcspec import LbService

    vip, other = {"v4": ("10.96.8.1", "10.96.8.2"), "v6": ("10.96.8.3", "10.96.8.4"),
                  "ipv6-service": ("fd00:96::8:5", "fd00:96::8:6")}[fam]
    v6 = fam == "ipv6-service"
    ip_of = host.lab.backend_ip6 if v6 else host.lab.backend_ip
    be = (lambda i: f"[{ip_of(i)}]:{PORT}") if v6 else host.be
    front = (lambda a: f"[{a}]") if v6 else (lambda a: a)
    fam = "v6" if v6 else fam
    host.kxlb("service", "add", f"{front(vip)}:53/udp", *[be(i) for i in range(3)])
    host.kxlb("service", "add", f"{front(vip)}:80/tcp", *[be(i) for i in range(3)])
    host.kxlb("service", "add", f"{front(other)}:53/udp", be(0))
    child = host.spawn(TEARDOWN_CHILD, fam, vip, other, "be0", *[ip_of(i) for i in range(3)])
    try:
        first = json.loads(child.stdout.readline() or "null")
        assert first, child.stderr.read()
        doomed = first["names"].count("be0")
        assert doomed >= 1 and first["other"] == "be0"
        host.kxlb("service", "set-backends", f"{front(vip)}:53/udp", be(1), be(2))
        host.kxlb("service", "set-backends", f"{front(vip)}:80/tcp", be(1), be(2))
        host.kxlb("service", "del", f"{front(other)}:53/udp")
        # What the controller passes after that sync: the UDP frontends still
        # programmed, each with its serving endpoints (`other` is gone).
        serving_set = frozenset(Backend(ip_of(i), PORT) for i in (1, 2))
        serving = serving_by_frontend([(LbService.simple(ServiceKey(vip, 53, 17), serving_set), serving_set)])
        reaper = UdpSocketReaper(host.pin_dir, host.lab.node)
        try:
            t0 = time.monotonic()
            assert reaper.reap(serving) == doomed
            took = time.monotonic() - t0
            assert reaper.reap(serving) == 0  # nothing left to destroy
        finally:
            reaper.close()
        child.stdin.write("go\n")
        child.stdin.flush()
        last = json.loads(child.stdout.readline() or "null")
        assert last, child.stderr.read()
    finally:
        child.kill()
        child.wait()
    for name, (status, now, peer) in zip(first["names"], last["rows"]):
        assert peer == vip
        if name == "be0":
            assert status == "ECONNABORTED" and now in {"be1", "be2"}
        else:
            assert status == "kept" and now == name
    assert last["directs"] == [["be0", "be0"], ["be1", "be1"], ["be2", "be2"]]
    assert last["other"] == "be0" and last["tcp"] == "be0"
    assert took < 1.0


def test_source_ranges_see_the_nodes_own_address_not_the_masquerade_one(host):
    """loadBalancerSourceRanges that allow the node: its processes pass even when
    --masquerade-address (snat_addr) is another address, because the socket hooks judge
    them by the node's own address, as kube-proxy's firewall sees the node's packets."""
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import DatapathConfig, ServiceTable

    node_ip, lb_ip = host.lab.node_client_ip, "10.250.100.9"
    host.kxlb("service", "add", "10.96.7.9:80/tcp", host.be(0), "--load-balancer-ip", lb_ip,
              "--source-range", f"{node_ip}/32")
    host.kxlb("service", "add", "10.96.7.10:80/tcp", host.be(0), "--load-balancer-ip", "10.250.100.10",
              "--source-range", "192.0.2.0/24")
    code = r'''
for ip in sys.argv[1:]:
    s = mk("v4", socket.SOCK_STREAM); s.settimeout(5)
    try: s.connect((ip, 80)); out("connected")
    except OSError as e: out(err(e))
'''
    with Maps.open(host.pin_dir) as maps:
        table = ServiceTable(maps)
        table.set_config(DatapathConfig(snat_addrs=("10.201.0.99",), node_addrs=(node_ip,)))
        try:
            assert host.run(code, lb_ip, "10.250.100.10") == ["connected", "ETIMEDOUT"]
        finally:
            table.set_config(DatapathConfig())
