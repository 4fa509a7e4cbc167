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

from kxlb.loader.bpfsys import BPF_F_TEST_SKB_CHECKSUM_COMPLETE, prog_test_run

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

    def run(self, frame, flags: int = 0) -> tuple[int, bytes]:
        raw = bytes(frame)
        verdict, out, _ = prog_test_run(self.fd, raw, flags=flags)
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


class CompleteHook(Hook):
    """tc with every skb CHECKSUM_COMPLETE, as from a NIC that sums each packet (mlx5 and
    many others): the kernel's test run fails (EBADMSG) when the program leaves skb->csum
    other than the sum of the packet's bytes, which the stack would then log as "hw csum
    failure". Not for the reject, which makes a new packet to send, not to receive."""

    def __init__(self, fd: int):
        super().__init__("tc", fd)

    def run(self, frame, flags: int = 0) -> tuple[int, bytes]:
        return super().run(frame, flags | BPF_F_TEST_SKB_CHECKSUM_COMPLETE)


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
import json, sys, threading
from kxlb.loader.layout import Backend, ServiceKey
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable
pin, key = sys.argv[1], ServiceKey.parse(sys.argv[2])
sets = [[Backend.parse(b) for b in s] for s in json.loads(sys.argv[3])]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with Maps.open(pin) as maps:
    table, flips = ServiceTable(maps), 0
    print("go", flush=True)
    while not stop.is_set():
        table.set_backends(key, sets[flips % 2])
        flips += 1
print(flips, flush=True)
"""


def clear_array(m) -> None:
    """Zero every non-zero entry of an array map (read in batches, written in one). For
    small arrays: a full read of a 1M-slot backend array takes half a second."""
    import ctypes

    size = ctypes.sizeof(m.value_t)
    raw, zero = m.values_raw(0, m.max_entries), bytes(size)
    block = 4096 * size                    # whole blocks of zeros skipped at C speed
    empty = bytes(block)
    dirty = [i for b in range(0, len(raw), block) if raw[b:b + block] != empty[:len(raw[b:b + block])]
             for i in range(b // size, min(b + block, len(raw)) // size) if raw[i * size:(i + 1) * size] != zero]
    _zero_slots(m, dirty)


def _zero_slots(m, indexes: list[int]) -> None:
    """Zero the entries of array map ``m`` at ``indexes``, in one batch write."""
    import ctypes

    if indexes:
        zero = bytes(ctypes.sizeof(m.value_t))
        m.put_many_raw(b"".join(i.to_bytes(4, "little") for i in indexes), zero * len(indexes), len(indexes))


def clear_runs(maps) -> None:
    """Zero the backend slots that frontends name, in both families (before the frontends
    go). A run no frontend names is never read (the datapath only reads a frontend's run),
    so what a killed writer left beyond them can stay, as it does on a node."""
    from kxlb.loader.layout import FAMILIES
    from kxlb.loader.services import runs_named

    for fam in FAMILIES:
        m = fam.map(maps, "backends")
        named = {i for base, n in runs_named(maps, fam) for i in range(base, min(base + n, m.max_entries))}
        _zero_slots(m, sorted(named))


@contextmanager
def clean_table(maps, **table_options) -> Iterator:
    """A ServiceTable on a shared datapath (fixture ``dp``); afterwards every entry a test
    may have left (services and what hangs off them, the flows) is gone and the node
    configuration is back to none."""
    from kxlb.loader.services import DatapathConfig, ServiceTable

    t = ServiceTable(maps, **table_options)
    try:
        yield t
    finally:
        clear_runs(maps)
        for m in (maps.services, maps.maglev, maps.src_ranges, maps.conntrack, maps.frags,
                  maps.affinity, maps.services6, maps.src_ranges6, maps.conntrack6, maps.frags6,
                  maps.affinity6):
            for k in list(m.keys()):
                m.delete(k)
        for m in (maps.masq_ports, maps.masq_ports6):  # arrays: every way emptied, its stamps too
            clear_array(m)
        t.set_config(DatapathConfig())


def start_flipper(pin: str, key, sets) -> subprocess.Popen:
    """Another process (as a controller would be) flips service ``key`` between two
    backend sets as fast as it can until ``flips_done``; returns once it has started.
    Bound by the traffic the test sends, not by a time: a slow machine (a VM under TCG)
    sends fewer packets a second and flips fewer times alike."""
    proc = subprocess.Popen([sys.executable, "-c", FLIPPER, pin, str(key),
                             json.dumps([[str(b) for b in s] for s in sets])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    return proc


def flips_done(proc: subprocess.Popen) -> int:
    """Stop the flipper; how many times it changed the service."""
    proc.stdin.close()
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


# A client holding connections open through the datapath: TCP connections (a line echoed by
# the lab's echo server, or "http": an HTTP/1.1 keep-alive connection asking agnhost's
# /hostname) and connected UDP sockets, each probed once per "probe" (it prints the backend
# that answered each), and a UDP stream of one datagram every 5 ms to count losses ("ping
# start", "ping stop" prints sent and received).
HOLDER = r"""
import json, socket, sys, threading, time
socks = []
for proto, host, port in json.loads(sys.argv[1]):
    if proto in ("tcp", "http"):
        s = socket.create_connection((host, port), timeout=5)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3); s.connect((host, port))
    socks.append((proto, s))
def probe():
    out = []
    for proto, s in socks:
        try:
            if proto == "http":
                s.sendall(b"GET /hostname HTTP/1.1\r\nHost: x\r\n\r\n"); data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(1000)
                    if not chunk:
                        raise ConnectionError("closed")
                    data += chunk
                head, body = data.split(b"\r\n\r\n", 1)
                length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += s.recv(1000)
                data = body
            elif proto == "tcp":
                s.sendall(b"x\n"); data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(100)
                    if not chunk:
                        raise ConnectionError("closed")
                    data += chunk
            else:
                s.send(b"x"); data = s.recv(100)
            out.append(data.split()[0].decode())
        except Exception as exc:
            out.append(f"error: {exc}")
    return out
ping = {"sent": 0, "got": set(), "run": False}
def pinger(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((host, port)); s.settimeout(0.005)
    while ping["run"]:
        s.send(str(ping["sent"]).encode()); ping["sent"] += 1
        t = time.monotonic() + 0.005
        while time.monotonic() < t:
            try:
                ping["got"].add(s.recv(100).split()[1])
            except (socket.timeout, OSError):
                pass
    end = time.monotonic() + 2
    while time.monotonic() < end:
        try:
            ping["got"].add(s.recv(100).split()[1])
        except (socket.timeout, OSError):
            pass
print(json.dumps(probe()), flush=True)
thread = None
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "probe":
        print(json.dumps(probe()), flush=True)
    elif cmd[0] == "ping" and cmd[1] == "start":
        ping["run"] = True
        thread = threading.Thread(target=pinger, args=(cmd[2], int(cmd[3]))); thread.start()
        print("[]", flush=True)
    elif cmd[0] == "ping" and cmd[1] == "stop":
        ping["run"] = False; thread.join()
        print(json.dumps({"sent": ping["sent"], "received": len(ping["got"])}), flush=True)
"""


class Holder:
    """Connections held open from namespace ``ns``: targets are (proto, host, port)."""

    def __init__(self, ns: str, targets: list):
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", HOLDER, json.dumps(targets)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        assert line, "the client holding the connections died"
        return json.loads(line)

    def ask(self, *words):
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.kill()
        self.proc.wait()
