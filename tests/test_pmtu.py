"""Path MTU discovery through a VIP, with real sockets (issue 8, item 5; issue 26,
defect 5).

The node forwards a client's translated TCP segments to a backend whose link has a
smaller MTU than both ends advertise, so the node itself answers "fragmentation needed",
quoting the translated packet (client -> backend). The client's kernel only knows a
socket to the VIP: without kxlb's tc egress program the error matches nothing there and
the upload stalls (no PMTU blackhole detection by default); with it the quote names the
VIP, the client learns the path MTU and the upload completes.

A masqueraded flow (a NodePort's outside client) leaves the node with the node's address
as its source: the kernel's error goes to the node itself and is lost. The datapath looks
up the route for such packets and answers the client itself (flow.tmpl.h masq_path_mtu),
on both families, whether or not GRO merged the client's segments.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from kxlb.loader.maps import Maps
from kxlb.loader.netns import netns
from kxlb.loader.services import DatapathConfig, ServiceTable

VIP, PORT, BPORT = "10.96.0.10", 80, 8080
SMALL_MTU = 1280  # IPv6 is off on a link below 1280 (RFC 8200 5), so both families use it
UPLOAD = 200_000

# Counts the bytes of one connection and answers with the count.
SINK = r"""
import socket, sys
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # both families
s.bind(("::", int(sys.argv[1]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); n = 0
    while True:
        b = c.recv(65536)
        if not b: break
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""


def kxlb(lab, *args):
    r = subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", lab.pin_dir, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


def upload(client_ns: str, timeout: float = 10, to: tuple[str, int] = (VIP, PORT)) -> int:
    with netns(client_ns):
        s = socket.create_connection(to, timeout=timeout)
    with s:
        s.sendall(b"z" * UPLOAD)
        s.shutdown(socket.SHUT_WR)
        return int(s.recv(64))


def route_mtu(ns: str, dst: str) -> str:
    return subprocess.run(["ip", "-n", ns, "route", "get", dst], capture_output=True, text=True).stdout


@pytest.fixture
def small_mtu_lab(netlab):
    """The lab with a sink behind a small-MTU hop, kxlb loaded, the service defined."""
    sink = subprocess.Popen(["ip", "netns", "exec", netlab.backend(0), sys.executable, "-c", SINK, str(BPORT)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        # Only the node's side of the backend link is small: both ends advertise an MSS
        # of 1460, so the node has to say "fragmentation needed".
        subprocess.run(["ip", "-n", netlab.node, "link", "set", netlab.backend_iface(0), "mtu", str(SMALL_MTU)],
                       check=True)
        kxlb(netlab, "load", "--netns", netlab.node,
             *[arg for iface in netlab.node_ifaces for arg in ("--iface", iface)])
        kxlb(netlab, "service", "add", f"{VIP}:{PORT}/tcp", f"{netlab.backend_ip(0)}:{BPORT}")
        yield netlab
    finally:
        sink.kill()
        sink.wait()
        kxlb(netlab, "unload")


def test_fragmentation_needed_from_the_node_reaches_the_client_as_the_vips(small_mtu_lab):
    lab = small_mtu_lab
    assert upload(lab.client) == UPLOAD
    assert f"mtu {SMALL_MTU}" in route_mtu(lab.client, VIP), route_mtu(lab.client, VIP)
    assert json.loads(kxlb(lab, "stats", "--json").stdout)["datapath"]["icmp_nat"] >= 1


def test_without_the_egress_program_the_upload_stalls(small_mtu_lab):
    """The control: the same upload with kxlb's egress filter removed never learns the
    path MTU (the error quotes a flow the client does not know) and stalls."""
    lab = small_mtu_lab
    subprocess.run(["tc", "-n", lab.node, "filter", "del", "dev", lab.client_iface, "egress"], check=True)
    with pytest.raises(TimeoutError):
        upload(lab.client, timeout=4)
    assert f"mtu {SMALL_MTU}" not in route_mtu(lab.client, VIP)


NODE_PORT = 30080


def masquerading(lab, *, tso: bool = True, gro: bool = False) -> dict[int, str]:
    """A NodePort on each family's node address, its outside client masqueraded to the
    node. How the client's segments reach the node's hook: as GSO batches (the client's
    TSO: a veth hands them on unsegmented), one by one (TSO and GSO off), or merged again
    (GRO on the node's device). Returns family -> node address."""
    if not tso:
        subprocess.run(["ip", "netns", "exec", lab.client, "ethtool", "-K", "eth0", "tso", "off", "gso", "off"],
                       check=True)
    if gro:
        subprocess.run(["ip", "netns", "exec", lab.node, "ethtool", "-K", lab.client_iface, "gro", "on"], check=True)
    node = {4: lab.node_client_ip, 6: lab.node_client_ip6}
    kxlb(lab, "service", "add", f"10.96.0.11:{PORT}/tcp", f"{lab.backend_ip(0)}:{BPORT}",
         "--node-port", f"{node[4]}:{NODE_PORT}")
    kxlb(lab, "service", "add", f"[fd00:96::11]:{PORT}/tcp", f"[{lab.backend_ip6(0)}]:{BPORT}",
         "--node-port", f"[{node[6]}]:{NODE_PORT}")
    with Maps.open(lab.pin_dir) as maps:
        ServiceTable(maps).set_config(DatapathConfig(snat_addrs=(node[4], node[6])))
    return node


def datapath_stats(lab) -> dict[str, int]:
    return json.loads(kxlb(lab, "stats", "--json").stdout)["datapath"]


@pytest.mark.parametrize("hook, tso, gro", [("tc", False, False), ("tc", True, False), ("tc", False, True),
                                             ("xdp", False, False)], ids=["tc", "tc-gso", "tc-gro", "xdp"])
@pytest.mark.parametrize("family", [4, 6])
def test_a_masqueraded_client_learns_the_path_mtu_from_the_datapath(small_mtu_lab, family, hook, tso, gro):
    lab = small_mtu_lab
    if hook == "xdp":  # the client's link at XDP, its sender finalising checksums
        subprocess.run(["ip", "netns", "exec", lab.client, "ethtool", "-K", "eth0", "tx", "off"], check=True)
        kxlb(lab, "load", "--netns", lab.node, "--iface", lab.client_iface, "--xdp", "--xdp-trust-checksums")
    node = masquerading(lab, tso=tso, gro=gro)[family]
    assert upload(lab.client, to=(node, NODE_PORT)) == UPLOAD
    assert f"mtu {SMALL_MTU}" in route_mtu(lab.client, node), route_mtu(lab.client, node)
    stats = datapath_stats(lab)
    assert stats["snat"] >= 1 and stats["pmtu"] >= 1, stats


@pytest.mark.parametrize("family", [4, 6])
def test_gso_batches_that_fit_the_path_are_not_answered(netlab, family):
    """A GSO batch (the client's TSO, or the node's GRO) is one packet far over any MTU:
    the datapath checks its segments, as the kernel does, not the merged length."""
    lab = netlab
    sink = subprocess.Popen(["ip", "netns", "exec", lab.backend(0), sys.executable, "-c", SINK, str(BPORT)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        kxlb(lab, "load", "--netns", lab.node, *[arg for iface in lab.node_ifaces for arg in ("--iface", iface)])
        node = masquerading(lab, gro=True)[family]
        assert upload(lab.client, to=(node, NODE_PORT)) == UPLOAD
        stats = datapath_stats(lab)
        assert stats["snat"] >= 1 and stats["pmtu"] == 0, stats
        assert "mtu" not in route_mtu(lab.client, node)
    finally:
        sink.kill()
        sink.wait()
        kxlb(lab, "unload")


# Sends a fixed number of bytes to each connection, then closes it.
SOURCE = r"""
import socket, sys
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", int(sys.argv[1]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"d" * int(sys.argv[2])); c.close()
"""


def download(client_ns: str, to: tuple[str, int], timeout: float = 10) -> int:
    with netns(client_ns):
        s = socket.create_connection(to, timeout=timeout)
    with s:
        got = 0
        while b := s.recv(65536):
            got += len(b)
        return got


@pytest.mark.parametrize("family", [4, 6])
def test_fragmentation_needed_about_a_reply_is_routed_to_the_backend(netlab, family):
    """A backend's reply does not fit the client's link: the node's error goes to the VIP
    (the reply's source), out of the route to the VIP (as a node's default route, toward
    the client here). Translated at egress it names the backend, and is sent on the
    backend's route: the backend learns the path MTU and the download completes."""
    lab = netlab
    vip, client = ("10.96.0.12", lab.client_ip) if family == 4 else ("fd00:96::12", lab.client_ip6)
    backend = lab.backend_ip(0) if family == 4 else lab.backend_ip6(0)
    src = subprocess.Popen(["ip", "netns", "exec", lab.backend(0), sys.executable, "-c", SOURCE, str(BPORT),
                            str(UPLOAD)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert src.stdout.readline().strip() == "ready"
        # Only the node's side of the client link is small: both ends advertise 1460.
        subprocess.run(["ip", "-n", lab.node, "link", "set", lab.client_iface, "mtu", str(SMALL_MTU)], check=True)
        subprocess.run(["ip", "-n", lab.node, "route", "add", "10.96.0.0/16", "via", lab.client_ip], check=True)
        subprocess.run(["ip", "-n", lab.node, "-6", "route", "add", "fd00:96::/64", "via", lab.client_ip6], check=True)
        kxlb(lab, "load", "--netns", lab.node, *[arg for iface in lab.node_ifaces for arg in ("--iface", iface)])
        addr = f"{vip}:{PORT}" if family == 4 else f"[{vip}]:{PORT}"
        kxlb(lab, "service", "add", f"{addr}/tcp", f"{backend}:{BPORT}" if family == 4 else f"[{backend}]:{BPORT}")
        assert download(lab.client, (vip, PORT)) == UPLOAD
        assert f"mtu {SMALL_MTU}" in route_mtu(lab.backend(0), client), route_mtu(lab.backend(0), client)
        assert datapath_stats(lab)["icmp_nat"] >= 1
    finally:
        src.kill()
        src.wait()
        kxlb(lab, "unload")
