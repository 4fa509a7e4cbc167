"""BPF_PROG_TEST_RUN harness: scapy frames in, kernel-run program, frames out."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from scapy.layers.inet import ICMP, IP, TCP, UDP, IPerror, TCPerror, UDPerror
from scapy.layers.l2 import Ether

from kxlb.loader.bpfsys import prog_test_run

TC_ACT_UNSPEC, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = -1, 0, 2, 7
XDP_DROP, XDP_PASS, XDP_TX = 1, 2, 3
# Not ours: tc hands the packet on to the next filter (TC_ACT_UNSPEC); XDP has no chain.
PASS = {"tc": TC_ACT_UNSPEC, "xdp": XDP_PASS}
# Rewritten by us and delivered: tc ends classification (TC_ACT_OK).
TRANSLATED = {"tc": TC_ACT_OK, "xdp": XDP_PASS}
DROP = {"tc": TC_ACT_SHOT, "xdp": XDP_DROP}
SENT_BACK = {"tc": TC_ACT_REDIRECT, "xdp": XDP_TX}  # out of the interface it came in on

CLIENT_MAC, NODE_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02"


@dataclass
class Hook:
    name: str  # "tc" or "xdp"
    fd: int

    def run(self, frame) -> tuple[int, bytes]:
        raw = bytes(frame)
        verdict, out, _ = prog_test_run(self.fd, raw)
        return ctypes.c_int32(verdict).value, out  # tc verdicts are signed (TC_ACT_UNSPEC)

    @property
    def passed(self) -> int:
        """The verdict for a packet that is not ours (left untouched)."""
        return PASS[self.name]

    @property
    def translated(self) -> int:
        """The verdict for a packet we rewrote and let through."""
        return TRANSLATED[self.name]

    @property
    def dropped(self) -> int:
        return DROP[self.name]

    @property
    def sent_back(self) -> int:
        return SENT_BACK[self.name]


def eth(payload):
    return Ether(src=CLIENT_MAC, dst=NODE_MAC) / payload


def assert_checksums(frame: bytes) -> Ether:
    """Parse ``frame`` and check the IPv4 and L4 checksums against scapy's own
    computation (for ICMP errors also the quoted IP header's and the ICMP checksum)."""
    p = Ether(frame)
    ip = p[IP]
    rebuilt = ip.copy()
    del rebuilt.chksum
    for layer in (TCP, UDP, ICMP):
        if layer in rebuilt and not (layer is UDP and ip[UDP].chksum == 0):
            del rebuilt[layer].chksum
    if IPerror in rebuilt:
        del rebuilt[IPerror].chksum
    rebuilt = IP(bytes(rebuilt))
    assert rebuilt.chksum == ip.chksum, f"IP checksum {ip.chksum:#x}, expected {rebuilt.chksum:#x}"
    for layer in (TCP, UDP, ICMP):
        if layer in ip and ip.frag == 0 and not ip.flags.MF:
            if layer is UDP and ip[UDP].chksum == 0:
                continue
            assert rebuilt[layer].chksum == ip[layer].chksum, \
                f"{layer.__name__} checksum {ip[layer].chksum:#x}, expected {rebuilt[layer].chksum:#x}"
    if IPerror in ip:
        assert rebuilt[IPerror].chksum == ip[IPerror].chksum, "quoted IP header checksum"
        _assert_quoted_l4_checksum(ip[IPerror], ip.len - ip.ihl * 4 - 8)
    return p


def _assert_quoted_l4_checksum(quoted, quote_len: int) -> None:
    """The quoted TCP/UDP checksum, when the ICMP error quotes the whole packet (Linux
    quotes up to 576 bytes, so small packets are quoted whole); a partial quote cannot
    be judged. The outer IP total length bounds the quote (scapy would hand over the
    frame's trailing bytes with it)."""
    raw = bytes(quoted)[:quote_len]
    if quoted.proto not in (6, 17) or quoted.frag or quoted.flags.MF or len(raw) < quoted.len:
        return
    inner = IP(raw[:quoted.len])
    layer = TCP if quoted.proto == 6 else UDP
    if layer not in inner or (layer is UDP and inner[UDP].chksum == 0):
        return
    got = inner[layer].chksum
    del inner[layer].chksum
    want = IP(bytes(inner))[layer].chksum
    assert got == want, f"quoted {layer.__name__} checksum {got:#x}, expected {want:#x}"


FLIPPER = """
import json, sys, time
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable
pin, seconds, key = sys.argv[1], float(sys.argv[2]), ServiceKey.parse(sys.argv[3])
sets = [[Backend.parse(b) for b in s] for s in json.loads(sys.argv[4])]
with Maps.open(pin) as maps:
    table, flips, end = ServiceTable(maps), 0, time.monotonic() + seconds
    print("go", flush=True)
    while time.monotonic() < end:
        table.set_backends(key, sets[flips % 2])
        flips += 1
print(flips, flush=True)
"""


@contextmanager
def clean_table(maps) -> Iterator:
    """A ServiceTable on a shared datapath (fixture ``dp``); afterwards every entry a test
    may have left (services and what hangs off them, the flows) is gone and the node
    configuration is back to none."""
    from kxlb.loader.services import DatapathConfig, ServiceTable

    t = ServiceTable(maps)
    try:
        yield t
    finally:
        for m in (maps.services, maps.backends, maps.maglev, maps.src_ranges, maps.conntrack, maps.frags,
                  maps.affinity, maps.services6, maps.backends6, maps.src_ranges6, maps.conntrack6, maps.frags6,
                  maps.affinity6):
            for k in list(m.keys()):
                m.delete(k)
        t.set_config(DatapathConfig())


def start_flipper(pin: str, seconds: float, key, sets) -> subprocess.Popen:
    """Another process (as a controller would be) flips service ``key`` between two
    backend sets as fast as it can for ``seconds``; returns once it has started."""
    proc = subprocess.Popen([sys.executable, "-c", FLIPPER, pin, str(seconds), str(key),
                             json.dumps([[str(b) for b in s] for s in sets])], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    return proc


def flips_done(proc: subprocess.Popen) -> int:
    """How many times the flipper changed the service (waits for it to end)."""
    flips = int(proc.stdout.read().split()[-1])
    proc.wait()
    return flips


__all__ = ["clean_table", "start_flipper", "flips_done", "Hook", "eth", "assert_checksums", "IP", "TCP", "UDP", "ICMP", "IPerror", "TCPerror",
           "UDPerror", "Ether", "PASS", "TRANSLATED", "DROP"]


def add_tc_filter(ns: str, iface: str, fd: int, pref: int, name: str = "other_tool") -> None:
    """Another tool's tc program (``fd``) on ``iface``'s clsact ingress at priority ``pref``."""
    from pyroute2 import IPRoute

    from kxlb.loader import attach
    from kxlb.loader.netns import netns

    with netns(ns):
        ipr = IPRoute()
    try:
        idx = ipr.link_lookup(ifname=iface)[0]
        ipr.tc("add-filter", "bpf", idx, ":1", fd=fd, name=name, parent=attach.TC_PARENT_INGRESS,
               classid=1, direct_action=True, prio=pref)
    finally:
        ipr.close()
