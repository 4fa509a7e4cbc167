"""`kxlb demo`: the standalone datapath in network namespaces, end to end.

Builds a node, a client and three backends (namespaces), loads the datapath on the
node's interfaces with `kxlb load` (a separate process that exits), declares a TCP and
a UDP service with `kxlb service add`, and sends requests from the client to the VIP,
printing which backend answered each one.
"""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

from .client import tcp_request, udp_request
from .netlab import NetLab, cleanup_stale

VIP, PORT = "10.96.0.10", 80
BACKEND_PORT = 8080


def kxlb(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kxlb", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"kxlb {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def run(requests: int, xdp: bool, keep: bool) -> None:
    cleanup_stale()
    lab = NetLab().up()
    try:
        lab.start_servers(BACKEND_PORT)
        print(f"lab: client {lab.client} ({lab.client_ip}), node {lab.node}, "
              f"backends {', '.join(f'{lab.backend(i)} ({lab.backend_ip(i)})' for i in range(lab.backends_n))}")
        if xdp:
            # XDP on veths is correct only if no CHECKSUM_PARTIAL packet reaches it: the
            # senders finalise their checksums (docs/datapath.md, Hooks and coexistence).
            for ns in [lab.client] + [lab.backend(i) for i in range(lab.backends_n)]:
                subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", "eth0", "tx", "off"], check=True,
                               capture_output=True)
        kxlb("--pin-dir", lab.pin_dir, "load", "--netns", lab.node, *(["--xdp", "--xdp-trust-checksums"] if xdp else []),
             *[arg for iface in lab.node_ifaces for arg in ("--iface", iface)])
        print(f"datapath: {'XDP (generic)' if xdp else 'tc ingress'} on {', '.join(lab.node_ifaces)} of {lab.node}; "
              f"maps pinned in {lab.pin_dir}; the loader has exited")
        backends = [f"{lab.backend_ip(i)}:{BACKEND_PORT}" for i in range(lab.backends_n)]
        for proto in ("tcp", "udp"):
            kxlb("--pin-dir", lab.pin_dir, "service", "add", f"{VIP}:{PORT}/{proto}", *backends)
        print(kxlb("--pin-dir", lab.pin_dir, "list"))
        for proto, send in (("tcp", tcp_request), ("udp", udp_request)):
            seen = Counter()
            for n in range(requests):
                reply, src = send(lab.client, VIP, PORT, f"request {n}")
                who = reply.split()[0]
                seen[who] += 1
                print(f"  {proto} request {n:2} -> answered by {who} (reply from {src[0]}:{src[1]})")
            print(f"{proto}: {dict(sorted(seen.items()))}\n")
        print(kxlb("--pin-dir", lab.pin_dir, "stats"))
        if keep:
            print("The lab stays up. Try:\n"
                  f"  ip netns exec {lab.client} nc {VIP} {PORT}\n"
                  f"  kxlb --pin-dir {lab.pin_dir} conntrack\n"
                  f"  kxlb --pin-dir {lab.pin_dir} service set-backends {VIP}:{PORT}/tcp {backends[0]}\n"
                  f"Tear down: kxlb --pin-dir {lab.pin_dir} unload; ip netns del for each {lab.tag}-* namespace "
                  f"(or run the demo again: it removes leftovers of finished runs).")
            lab.servers.clear()  # leave them running with the lab
    finally:
        if not keep:
            lab.down()


def register(sub) -> None:
    p = sub.add_parser("demo", help="standalone demo: namespaces, real servers, traffic through a VIP")
    p.add_argument("--requests", type=int, default=6, help="requests per protocol (default %(default)s)")
    p.add_argument("--xdp", action="store_true", help="use the XDP program instead of tc")
    p.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    p.set_defaults(func=lambda a: run(a.requests, a.xdp, a.keep))
