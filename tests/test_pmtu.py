"""Path MTU discovery through a VIP, with real sockets (issue 8, item 5).

The node forwards a client's translated TCP segments to a backend whose link has a
smaller MTU than both ends advertise, so the node itself answers "fragmentation needed",
quoting the translated packet (client -> backend). The client's kernel only knows a
socket to the VIP: without kxlb's tc egress program the error matches nothing there and
the upload stalls (no PMTU blackhole detection by default); with it the quote names the
VIP, the client learns the path MTU and the upload completes.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from kxlb.loader.netns import netns

VIP, PORT, BPORT = "10.96.0.10", 80, 8080
SMALL_MTU = 1000
UPLOAD = 200_000

# Counts the bytes of one connection and answers with the count.
SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4); print("ready", flush=True)
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


def upload(client_ns: str, timeout: float = 10) -> int:
    with netns(client_ns):
        s = socket.create_connection((VIP, PORT), timeout=timeout)
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
