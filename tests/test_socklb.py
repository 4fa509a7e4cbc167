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

    def _argv(self, code: str, args, ns: str | None = None, cgroup: str | None = None) -> list[str]:
        # Into the cgroup first (`ip netns exec` remounts /sys), then the node's netns
        # (a pod's: the lab's client namespace, in the same cgroup as a real node's root).
        return ["sh", "-c", f'echo $$ > {cgroup or self.cgroup}/cgroup.procs && exec ip netns exec '
                f'{ns or self.lab.node} {sys.executable} -c "$0" "$@"', PRELUDE + code, *map(str, args)]

    def run(self, code: str, *args, ns: str | None = None, cgroup: str | None = None) -> list:
        """Run ``code`` as a host process (in ``ns``: another namespace of the cgroup);
        returns the JSON lines it printed."""
        r = subprocess.run(self._argv(code, args, ns, cgroup), capture_output=True, text=True, timeout=60)
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
            attach_socket_lb(lab.pin_dir, h.cgroup, lab.node)  # the node's sockets are the host's
            yield h
        finally:
            os.rmdir(h.cgroup)  # detaches the hooks


def cgroup_programs(cgroup: str) -> list[tuple[str, str, str]]:
    """(attach type, program name, attach flags) of every program attached to ``cgroup``."""
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup], capture_output=True, text=True).stdout
    return [(p["attach_type"], p["name"], p["attach_flags"]) for p in json.loads(out.strip() or "[]")]


def test_all_eight_hooks_are_attached(host):
    """Each once, beside others (BPF_F_ALLOW_MULTI): attached exclusively they would
    forbid every other tool's program of their types on this cgroup and below it."""
    progs = cgroup_programs(host.cgroup)
    assert {flags for _, _, flags in progs} == {"multi"}
    got = {t: name for t, name, _ in progs}
    assert len(got) == len(progs) == 8
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


def test_a_udp_lite_socket_is_not_taken_for_a_udp_one(host):
    """The hooks look up a socket's protocol, not its type: a UDP-Lite socket (SOCK_DGRAM,
    IPPROTO_UDPLITE) is no client of a UDP Service (kxlb 0.2 translated it to a UDP
    backend, which cannot answer UDP-Lite). UDP-Lite shares UDP's sendmsg, and with it the
    sendmsg hook: left alone, its sendto() meets the VIP's missing route as it would
    without kxlb, while a UDP socket beside it is translated (its kernel-side peer, from
    /proc/net/udp, is the backend)."""
    host.kxlb("service", "add", "10.96.7.20:53/udp", host.be(0))
    code = r'''
import struct
lite = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDPLITE)
try: lite.sendto(b"q", ("10.96.7.20", 53)); out("sent")
except OSError as e: out(err(e))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.connect(("10.96.7.20", 53))
for line in open("/proc/net/udp").read().splitlines()[1:]:
    local, rem = line.split()[1:3]
    if int(local.split(":")[1], 16) == udp.getsockname()[1]:
        a, p = rem.split(":")
        out([socket.inet_ntoa(struct.pack("<I", int(a, 16))), int(p, 16)])
'''
    assert host.run(code) == ["ENETUNREACH", [host.lab.backend_ip(0), PORT]]


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


# --- pods: their sockets are not the host's ---------------------------------------------------------
@pytest.fixture
def pods(host):
    """The lab's client namespace as a pod of the node: its processes in the hooks'
    cgroup (a real node's root cgroup holds its pods), its packets through tc hooks on
    the node's interfaces, as a pod's cross the tc hook on its veth."""
    from kxlb.loader import attach, devconf
    from kxlb.loader.compile import pinned_datapath
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import DatapathConfig, ServiceTable

    lab = host.lab
    dp = pinned_datapath(host.pin_dir)
    maps = Maps.open(host.pin_dir)
    table = ServiceTable(maps)
    try:
        # External frontends masquerade (eTP Cluster): to the node's address toward the pod.
        table.set_config(DatapathConfig(snat_addrs=(lab.node_client_ip, lab.node_client_ip6),
                                        node_addrs=(lab.node_client_ip, lab.node_client_ip6)))
        for iface in lab.node_ifaces:
            devconf.prepare_interface(lab.node, iface)  # as a load does: masqueraded packets come from the node
            attach.attach_tc(lab.node, iface, dp.tc_fd, "ingress")
            attach.attach_tc(lab.node, iface, dp.tc_egress_fd, "egress")
        yield host
    finally:
        for iface in lab.node_ifaces:
            attach.detach_tc(lab.node, iface)
        table.set_config(DatapathConfig())
        maps.close()
        for fd in (dp.tc_fd, dp.xdp_fd, dp.tc_egress_fd):
            os.close(fd)


JUDGED = r'''
# TCP connect and unconnected UDP to each load-balancer IP: [backend, peer] or the error.
fam = sys.argv[1]
def one(kind, ip, port, send):
    s = mk(fam, kind); s.settimeout(1.5)
    try:
        data, peer = send(s, addr(fam, ip, port))
        return [data.decode().split()[0], peer[0].removeprefix("::ffff:")]
    except OSError as e:
        return "no answer" if e.errno is None else err(e)
def tcp(s, a):
    s.connect(a); s.sendall(b"t\n"); return s.recv(100), s.getpeername()
def udp(s, a):
    s.sendto(b"u", a); return s.recvfrom(100)
for ip in sys.argv[2:]:
    out([one(socket.SOCK_STREAM, ip, 80, tcp), one(socket.SOCK_DGRAM, ip, 53, udp)])
'''


@pytest.mark.parametrize("fam", ["v4", "v6", "ipv6-service"])
def test_a_pods_sockets_are_judged_as_the_pod_not_as_the_node(pods, fam):
    """loadBalancerSourceRanges that admit the pod's address but not the node's, and the
    reverse. A pod's socket is not translated by the hooks (its namespace is not the
    host's): its packets reach tc, which judges the pod's address. The node's processes
    are still translated by the hooks and judged by the node's address. (Judged as the
    node, the pod would be refused the first frontend and admitted to the second.)"""
    lab = pods.lab
    six = fam == "ipv6-service"
    net = {"v4": "10.96.9.", "v6": "10.96.10.", "ipv6-service": "fd00:96::9:"}[fam]
    pod_only, node_only, lb_pod_only, lb_node_only = (net + n for n in ("1", "2", "11", "12"))
    if six:
        pod_addr, node_addr, be, fam = lab.client_ip6, lab.node_client_ip6, f"[{lab.backend_ip6(0)}]:{PORT}", "v6"
        front = lambda a: f"[{a}]"  # noqa: E731
    else:
        pod_addr, node_addr, be, front = lab.client_ip, lab.node_client_ip, pods.be(0), (lambda a: a)
    bits = 128 if six else 32
    for proto in ("tcp", "udp"):
        port = 80 if proto == "tcp" else 53
        pods.kxlb("service", "add", f"{front(pod_only)}:{port}/{proto}", be, "--load-balancer-ip", lb_pod_only,
                  "--source-range", f"{pod_addr}/{bits}")
        pods.kxlb("service", "add", f"{front(node_only)}:{port}/{proto}", be, "--load-balancer-ip", lb_node_only,
                  "--source-range", f"{node_addr}/{bits}")
    from_pod = pods.run(JUDGED, fam, lb_pod_only, lb_node_only, ns=lab.client)
    from_node = pods.run(JUDGED, fam, lb_pod_only, lb_node_only)
    assert from_pod == [[["be0", lb_pod_only]] * 2, ["no answer"] * 2]
    assert from_node == [["ETIMEDOUT"] * 2, [["be0", lb_node_only]] * 2]


# --- good neighbour: other tools' cgroup programs ------------------------------------------------------
OTHER_TOOL = r"""
BPF_ARRAY(calls, u64, 1);
static __always_inline int count(void)
{
	int zero = 0;
	u64 *n = calls.lookup(&zero);

	if (n)
		__sync_fetch_and_add(n, 1);
	return 1;
}
int other_connect4(struct bpf_sock_addr *ctx) { return count(); }
int other_connect6(struct bpf_sock_addr *ctx) { return count(); }
"""


class OtherTool:
    """Another tool's cgroup programs (a monitor): they count the connect() calls they see."""

    def __init__(self):
        from bcc import BPF

        from kxlb.loader.socklb import ATTACH_TYPES

        self.bpf = BPF(text=OTHER_TOOL.encode())
        self.progs = {name: (self.bpf.load_func(name.encode(), BPF.CGROUP_SOCK_ADDR, attach_type=ATTACH_TYPES[t]).fd,
                             ATTACH_TYPES[t])
                      for name, t in (("other_connect4", "CGROUP_INET4_CONNECT"),
                                      ("other_connect6", "CGROUP_INET6_CONNECT"))}

    def attach(self, name: str, cgroup: str, flags: int) -> None:
        from kxlb.loader import bpfsys

        fd, atype = self.progs[name]
        cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            bpfsys.check(bpfsys.lib().bpf_prog_attach(fd, cg, atype, flags), f"attach {name}")
        finally:
            os.close(cg)

    @property
    def calls(self) -> int:
        import ctypes

        return self.bpf[b"calls"][ctypes.c_int(0)].value


@pytest.fixture(scope="module")
def other_tool():
    return OtherTool()


@pytest.fixture
def cgroup():
    """A cgroup of its own (the host fixture's keeps its hooks): removing it detaches
    whatever is attached there."""
    from kxlb.lab.netlab import unique_tag

    path = f"/sys/fs/cgroup/unified/{unique_tag()}"
    os.makedirs(path)
    yield path
    os.rmdir(path)


KXLB_HOOKS = sorted(f"kxlb_{h}{f}" for h in ("connect", "sendmsg", "recvmsg", "getpeername") for f in "46")
CONNECT_VIP = r'''
s = mk("v4", socket.SOCK_STREAM); s.settimeout(3)
try: s.connect((sys.argv[1], 80)); s.sendall(b"t\n"); out(s.recv(100).decode().split()[0])
except OSError as e: out(err(e))
'''


def test_another_tools_programs_keep_running_beside_ours(host, other_tool, cgroup):
    """Another tool's connect4 program on the hooks' cgroup (attached with
    BPF_F_ALLOW_MULTI, as a neighbour does) stays attached and keeps running when kxlb
    attaches, attaches again the same build, switches to a new build (what a load does)
    and detaches; a tool attaching after kxlb is not refused; and kxlb never has two
    programs on one hook. (Attached exclusively, kxlb was refused beside the first tool,
    and refused the second.)"""
    from kxlb.loader.socklb import (BPF_F_ALLOW_MULTI, attach_sock_programs, attach_socket_lb, compile_sock,
                                    detach_socket_lb, host_netns_of, netns_cookie)

    def ours():
        return sorted(name for _, name, _ in cgroup_programs(cgroup) if name.startswith("kxlb_"))

    def connect4_order():
        return [name for t, name, _ in cgroup_programs(cgroup) if t == "cgroup_inet4_connect"]

    def connect(vip):
        before = other_tool.calls
        got = host.run(CONNECT_VIP, vip, cgroup=cgroup)[0]
        return got, other_tool.calls - before

    host.kxlb("service", "add", "10.96.7.30:80/tcp", host.be(1))
    other_tool.attach("other_connect4", cgroup, BPF_F_ALLOW_MULTI)
    attach_socket_lb(host.pin_dir, cgroup, host.lab.node)
    assert ours() == KXLB_HOOKS
    assert connect4_order() == ["other_connect4", "kxlb_connect4"]  # in the order they came
    assert connect("10.96.7.30") == ("be1", 1)

    attach_socket_lb(host.pin_dir, cgroup, host.lab.node)  # the same build again: nothing to replace
    assert ours() == KXLB_HOOKS and connect4_order() == ["other_connect4", "kxlb_connect4"]

    new = compile_sock(host.pin_dir)  # the next build, as a load stages it, then switches to it
    assert host_netns_of(new.values()) == 0
    attach_sock_programs(new, cgroup)
    assert ours() == KXLB_HOOKS and connect4_order() == ["other_connect4", "kxlb_connect4"]  # in place
    ids = {p["name"]: p["id"] for p in json.loads(subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup],
                                                                  capture_output=True, text=True).stdout)}
    from kxlb.loader.attach import prog_ref

    assert {ids[n] for n in KXLB_HOOKS} == {prog_ref(fd).id for fd in new.values()}
    assert host_netns_of(new.values()) == netns_cookie(host.lab.node)  # the host namespace came along
    assert connect("10.96.7.30") == ("be1", 1)

    other_tool.attach("other_connect6", cgroup, BPF_F_ALLOW_MULTI)  # a tool arriving after kxlb
    assert detach_socket_lb(cgroup) == 8
    assert sorted(name for _, name, _ in cgroup_programs(cgroup)) == ["other_connect4", "other_connect6"]
    assert connect("10.96.7.30") == ("ENETUNREACH", 1)  # not translated any more; still counted


def test_another_tools_exclusive_program_is_not_replaced(host, other_tool, cgroup):
    """A program attached without BPF_F_ALLOW_MULTI allows no other on its attach type:
    kxlb refuses to attach, naming it, and changes nothing (it used to replace it)."""
    from kxlb.loader.errors import KxlbError
    from kxlb.loader.socklb import attach_socket_lb

    other_tool.attach("other_connect4", cgroup, 0)
    with pytest.raises(KxlbError, match=r"cgroup_inet4_connect holds another tool's program.*other_connect4"):
        attach_socket_lb(host.pin_dir, cgroup, host.lab.node)
    assert cgroup_programs(cgroup) == [("cgroup_inet4_connect", "other_connect4", "")]


def test_a_cgroup_above_that_forbids_the_hooks_refuses_them_before_any_change(host, other_tool, cgroup):
    """An exclusive program on a parent cgroup forbids its attach type below it (the
    kernel's rule): kxlb names it and attaches none of its hooks, not the four that come
    before the forbidden one."""
    from kxlb.loader.errors import KxlbError
    from kxlb.loader.socklb import attach_socket_lb

    other_tool.attach("other_connect6", cgroup, 0)
    child = os.path.join(cgroup, "pods")
    os.mkdir(child)
    try:
        with pytest.raises(KxlbError, match=rf"cgroup {cgroup} holds .*other_connect6.* on cgroup_inet6_connect"):
            attach_socket_lb(host.pin_dir, child, host.lab.node)
        assert cgroup_programs(child) == []
    finally:
        os.rmdir(child)


def test_hooks_attached_exclusively_by_an_older_kxlb_are_replaced_beside_others(host, cgroup):
    """kxlb before BPF_F_ALLOW_MULTI attached its hooks exclusively: attaching now takes
    their places with one program each, attached so that others may join."""
    from kxlb.loader import bpfsys
    from kxlb.loader.socklb import ATTACH_TYPES, HOOKS, attach_socket_lb, pinned_sock_programs

    fds = pinned_sock_programs(host.pin_dir)
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, fd in fds.items():
            bpfsys.check(bpfsys.lib().bpf_prog_attach(fd, cg, ATTACH_TYPES[HOOKS[name]], 0), name)
    finally:
        os.close(cg)
        for fd in fds.values():
            os.close(fd)
    assert {flags for _, _, flags in cgroup_programs(cgroup)} == {""}
    attach_socket_lb(host.pin_dir, cgroup, host.lab.node)
    progs = cgroup_programs(cgroup)
    assert sorted(name for _, name, _ in progs) == KXLB_HOOKS and {flags for _, _, flags in progs} == {"multi"}
    assert host.run(CONNECT_VIP, "10.96.7.30", cgroup=cgroup) == ["be1"]
