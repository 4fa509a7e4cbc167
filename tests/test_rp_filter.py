"""Strict reverse-path filtering (net.ipv4.conf.*.rp_filter=1: CIS benchmarks, kind) on a
node: translation happens at tc ingress, before routing, so a reply enters with a service
address as its source and a masqueraded packet with the node's; a strict filter drops
both. The loader makes each hooked device loose (loader/devconf.py), through rtnetlink
(no /proc/sys write: a DaemonSet without privilege can do it)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kxlb.lab.client import backends_answering, tcp_request
from kxlb.loader import datapath, devconf
from kxlb.loader.errors import KxlbError
from kxlb.loader.maps import Maps
from kxlb.loader.services import DatapathConfig, ServiceTable

VIP = "10.96.6.1"


def kxlb(pin_dir, *args):
    return subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args], capture_output=True, text=True)


@pytest.fixture
def strict(netlab):
    """The netlab's node hardened: strict filtering everywhere, and (as a real node has a
    default route) a route to the service range, into the lab."""
    n = netlab.node
    for key in ("all", "default", *netlab.node_ifaces):
        subprocess.run(["ip", "netns", "exec", n, "sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=1"], check=True)
    subprocess.run(["ip", "-n", n, "route", "add", "10.96.0.0/16", "via", netlab.client_ip], check=True)
    netlab.start_servers(8080)
    return netlab


def test_translated_flows_pass_a_strict_node(strict):
    lab, pin = strict, strict.pin_dir
    r = kxlb(pin, "load", "--netns", lab.node, *[a for i in lab.node_ifaces for a in ("--iface", i)])
    assert r.returncode == 0, r.stderr
    for i in lab.node_ifaces:  # loose where it was strict; conf.all untouched
        assert devconf.get_conf(lab.node, i, "rp_filter") == devconf.RP_LOOSE
    assert devconf.get_conf(lab.node, "all", "rp_filter") == devconf.RP_STRICT
    assert kxlb(pin, "service", "add", f"{VIP}:80/tcp", *[f"{lab.backend_ip(i)}:8080" for i in range(3)],
                "--node-port", f"{lab.node_client_ip}:30080").returncode == 0
    with Maps.open(pin) as maps:  # the NodePort's outside client is masqueraded to the node
        ServiceTable(maps).set_config(DatapathConfig(snat_addrs=(lab.node_client_ip,)))
    want = {"be0", "be1", "be2"}            # replies with the VIP as their source got in
    assert backends_answering(lab.client, VIP, 80, want) == want
    reply, peer = tcp_request(lab.client, lab.node_client_ip, 30080, "clientip")
    assert reply.split()[1].startswith(lab.node_client_ip + ":") and peer[0] == lab.node_client_ip  # masqueraded


def test_a_device_that_stays_strict_is_refused(strict, monkeypatch):
    monkeypatch.setattr(devconf, "set_conf", lambda ns, iface, values: None)  # a write that takes no effect
    with pytest.raises(KxlbError, match="reverse-path filtering on cli0 stays strict"):
        datapath.load(["cli0"], strict.node, pin_dir=strict.pin_dir)


def test_settings_are_written_without_proc_sys(netlab):
    """rtnetlink, not /proc/sys: the same values a sysctl write gives."""
    devconf.set_conf(netlab.node, "cli0", {"accept_local": 1, "rp_filter": 2})
    assert devconf.get_conf(netlab.node, "cli0", "accept_local") == 1
    assert devconf.get_conf(netlab.node, "cli0", "rp_filter") == 2
    devconf.set_conf(netlab.node, "cli0", {"accept_local": 0})
    assert devconf.get_conf(netlab.node, "cli0", "accept_local") == 0
    with pytest.raises(KxlbError, match="interface 'nosuch0' not found"):
        devconf.set_conf(netlab.node, "nosuch0", {"accept_local": 1})
