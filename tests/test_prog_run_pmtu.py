"""The answer to a masqueraded packet too big for its backend's path, byte by byte, run in
the kernel with BPF_PROG_TEST_RUN (tests/test_pmtu.py sends real traffic through it).

A test run's packet arrives on the loopback device of the caller's network namespace, and
the datapath's route lookup (bpf_fib_lookup) is that namespace's: each case runs inside a
namespace of its own where forwarding is on and the backends sit behind a 1280-byte link.
"""
from __future__ import annotations

import subprocess

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPerror, TCPerror, UDPerror
from scapy.layers.inet6 import ICMPv6PacketTooBig, IPerror6, IPv6
from scapy.layers.l2 import Ether

from harness import CLIENT_MAC, NODE_MAC, assert_checksums, clean_table, eth
from kxlb.lab.netlab import unique_tag
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.netns import netns
from kxlb.loader.services import DatapathConfig
from test_prog_run_ipv6 import assert_checksums6

OUTSIDE, OUTSIDE6 = "192.0.2.9", "2001:db8::9"      # clients outside the cluster: masqueraded
NODE_IP, NODE6 = "10.250.0.11", "fd00:250::11"
VIP, VIP6, PORT = "10.96.0.10", "fd00:96::10", 80
BACKEND, BACKEND6, BPORT = "10.1.0.11", "fd00:1::11", 8080
PATH_MTU = 1280


@pytest.fixture
def routed():
    """A namespace where the backends' link has a 1280-byte MTU and forwarding is on."""
    ns = f"{unique_tag()}-pmtu"  # lab.netlab.cleanup_stale() removes it after a crashed run
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "d0", "mtu", str(PATH_MTU), "type", "veth", "peer", "d1"],
                    ["addr", "add", "10.1.0.1/24", "dev", "d0"], ["addr", "add", "fd00:1::1/64", "dev", "d0", "nodad"],
                    ["link", "set", "d0", "up"], ["link", "set", "d1", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        for key in ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"):
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", key], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.fixture
def table(dp):
    with clean_table(dp[1]) as t:
        t.add(ServiceKey(VIP, PORT, 6), [Backend(BACKEND, BPORT)])
        t.add(ServiceKey(VIP, PORT, 17), [Backend(BACKEND, BPORT)])
        t.add(ServiceKey(VIP6, PORT, 6), [Backend(BACKEND6, BPORT)])
        t.set_config(DatapathConfig(snat_addrs=(NODE_IP, NODE6), cluster_cidrs=("10.0.0.0/16", "fd00::/16")))
        yield t


def frame(family: int, proto, size: int, sport: int, df: bool = True):
    l4 = proto(sport=sport, dport=PORT, **({"flags": "A", "seq": 7000} if proto is TCP else {}))
    ip = IP(src=OUTSIDE, dst=VIP, flags="DF" if df else 0) if family == 4 else IPv6(src=OUTSIDE6, dst=VIP6)
    return eth(ip / l4 / (b"p" * (size - len(ip / l4))))


@pytest.mark.parametrize("proto", [TCP, UDP])
def test_a_masqueraded_packet_over_the_path_mtu_gets_fragmentation_needed(hook, table, routed, proto):
    with netns(routed):
        hook.run(frame(4, proto, 100, 40100))                   # the flow, masqueraded
        big = frame(4, proto, 1400, 40100)
        verdict, out = hook.run(big)
    assert verdict == hook.sent_back
    p = assert_checksums(out)
    assert (p[Ether].src, p[Ether].dst) == (NODE_MAC, CLIENT_MAC)
    assert (p[IP].src, p[IP].dst) == (VIP, OUTSIDE) and (p[ICMP].type, p[ICMP].code) == (3, 4)
    assert p[ICMP].nexthopmtu == PATH_MTU
    q = p[IPerror]   # the packet the client sent, untranslated
    assert (q.src, q.dst) == (OUTSIDE, VIP) and bytes(q)[:28] == bytes(big[IP])[:28]
    layer = TCPerror if proto is TCP else UDPerror
    assert (q[layer].sport, q[layer].dport) == (40100, PORT)


def test_a_masqueraded_ipv6_packet_over_the_path_mtu_gets_packet_too_big(hook, table, routed):
    with netns(routed):
        hook.run(frame(6, TCP, 100, 40200))
        big = frame(6, TCP, 1400, 40200)
        verdict, out = hook.run(big)
    assert verdict == hook.sent_back
    p = assert_checksums6(out)
    assert (p[IPv6].src, p[IPv6].dst) == (VIP6, OUTSIDE6) and p[ICMPv6PacketTooBig].mtu == PATH_MTU
    assert bytes(p[IPerror6])[:48] == bytes(big[IPv6])[:48]


@pytest.mark.parametrize("size, df", [(PATH_MTU, True), (1400, False)], ids=["fits", "may-fragment"])
def test_what_fits_or_may_be_fragmented_is_translated(hook, table, routed, size, df):
    with netns(routed):
        hook.run(frame(4, TCP, 100, 40300))
        verdict, out = hook.run(frame(4, TCP, size, 40300, df=df))
    assert verdict == hook.translated
    p = assert_checksums(out)
    assert (p[IP].src, p[IP].dst, len(p[IP])) == (NODE_IP, BACKEND, size)
