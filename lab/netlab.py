"""A standalone lab in network namespaces: one node (the router where kxlb runs), a
client, and N backends that run the echo server.

    client (10.201.0.2) --- cli0 [node] beI --- backend I (10.201.I+1.2)

The client routes only the VIP range (and nothing else) through the node; the node has
no uplink: traffic never leaves the namespaces. Names carry the creating PID, so
leftovers of a crashed run are recognised and removed (``cleanup_stale``).
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kxlb.loader.errors import KxlbError

from .procs import alive

PREFIX = "kxl"
VIP_RANGE = "10.96.0.0/16"
VIP_RANGE6 = "fd00:96::/64"
_counter = itertools.count()


def unique_tag() -> str:
    """A name no other run uses; carries our PID so cleanup_stale() can tell leftovers."""
    return f"{PREFIX}{os.getpid()}x{next(_counter)}"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise KxlbError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def cleanup_stale() -> list[str]:
    """Delete lab namespaces, bpffs pins and cgroups left by processes that are gone."""
    removed = []
    for ns in sh("ip", "netns", "list").stdout.split():
        m = re.fullmatch(rf"{PREFIX}(\d+)x\d+-\w+", ns)
        if m and not alive(int(m.group(1))):
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    cgroups = "/sys/fs/cgroup/unified"  # tests put host-network processes in kxl* cgroups
    for d in os.listdir(cgroups) if os.path.isdir(cgroups) else []:
        m = re.fullmatch(rf"{PREFIX}(\d+)x\d+", d)
        if m and not alive(int(m.group(1))):
            try:
                os.rmdir(os.path.join(cgroups, d))  # detaches any program attached there
                removed.append(d)
            except OSError:
                pass
    for d in os.listdir("/sys/fs/bpf") if os.path.isdir("/sys/fs/bpf") else []:
        m = re.fullmatch(rf"{PREFIX}(\d+)x\d+", d)
        if m and not alive(int(m.group(1))):
            shutil.rmtree(f"/sys/fs/bpf/{d}", ignore_errors=True)
            removed.append(d)
    return removed


@dataclass
class NetLab:
    backends_n: int = 3
    tag: str = field(default_factory=lambda: unique_tag())
    servers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def node(self) -> str:
        return f"{self.tag}-node"

    @property
    def client(self) -> str:
        return f"{self.tag}-client"

    def backend(self, i: int) -> str:
        return f"{self.tag}-be{i}"

    @property
    def pin_dir(self) -> str:
        return f"/sys/fs/bpf/{self.tag}"

    client_ip = "10.201.0.2"
    node_client_ip = "10.201.0.1"
    client_ip6 = "fd00:201::2"
    node_client_ip6 = "fd00:201::1"
    client_iface = "cli0"  # on the node, toward the client

    def backend_ip(self, i: int) -> str:
        return f"10.201.{i + 1}.2"

    def backend_ip6(self, i: int) -> str:
        return f"fd00:201:{i + 1}::2"

    def backend_iface(self, i: int) -> str:
        return f"be{i}"  # on the node, toward backend i

    @property
    def node_ifaces(self) -> list[str]:
        return [self.client_iface] + [self.backend_iface(i) for i in range(self.backends_n)]

    def up(self) -> "NetLab":
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        for ns in [self.node, self.client] + [self.backend(i) for i in range(self.backends_n)]:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        n = self.node
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
                    "net.ipv6.conf.all.forwarding=1"):
            sh("ip", "netns", "exec", n, "sysctl", "-qw", key)
        # Dual-stack: every link has an IPv4 /24 and an IPv6 /64 (fd00:201:N::/64).
        self._link(self.client_iface, self.client, (self.node_client_ip, self.node_client_ip6),
                   (self.client_ip, self.client_ip6))
        sh("ip", "-n", self.client, "route", "add", VIP_RANGE, "via", self.node_client_ip)
        sh("ip", "-n", self.client, "-6", "route", "add", VIP_RANGE6, "via", self.node_client_ip6)
        for i in range(self.backends_n):
            self._link(self.backend_iface(i), self.backend(i), (f"10.201.{i + 1}.1", f"fd00:201:{i + 1}::1"),
                       (self.backend_ip(i), self.backend_ip6(i)))
            sh("ip", "-n", self.backend(i), "route", "add", "10.201.0.0/16", "via", f"10.201.{i + 1}.1")
            sh("ip", "-n", self.backend(i), "-6", "route", "add", "fd00:201::/48", "via", f"fd00:201:{i + 1}::1")
        sh("ip", "-n", self.client, "route", "add", "10.201.0.0/16", "via", self.node_client_ip)
        sh("ip", "-n", self.client, "-6", "route", "add", "fd00:201::/48", "via", self.node_client_ip6)

    def _link(self, node_if: str, peer_ns: str, node_ips: tuple[str, str], peer_ips: tuple[str, str]) -> None:
        sh("ip", "-n", self.node, "link", "add", node_if, "type", "veth", "peer", "name", "eth0", "netns", peer_ns)
        for ns, dev, (ip4, ip6) in ((self.node, node_if, node_ips), (peer_ns, "eth0", peer_ips)):
            sh("ip", "-n", ns, "addr", "add", f"{ip4}/24", "dev", dev)
            # nodad: usable at once (duplicate address detection would hold it a second)
            sh("ip", "-n", ns, "addr", "add", f"{ip6}/64", "dev", dev, "nodad")
        sh("ip", "-n", self.node, "link", "set", node_if, "up")
        sh("ip", "-n", peer_ns, "link", "set", "eth0", "up")

    def start_servers(self, *ports: int) -> None:
        """Start the echo server in every backend, named be0, be1, ..."""
        for i in range(self.backends_n):
            args = [sys.executable, "-m", "kxlb.lab.echo", "--name", f"be{i}", "--netns", self.backend(i), "--ipv6"]
            for p in ports:
                args += ["--port", str(p)]
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
            self.servers.append(proc)
            if proc.stdout.readline().strip() != "ready":
                raise KxlbError(f"echo server in {self.backend(i)} did not start")

    def stop_servers(self) -> None:
        for p in self.servers:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.servers.clear()

    def down(self) -> None:
        self.stop_servers()
        for ns in [self.node, self.client] + [self.backend(i) for i in range(self.backends_n)]:
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.pin_dir, ignore_errors=True)  # the pins, and kxlb's registry with them

    def __enter__(self) -> "NetLab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def wait_until(cond, timeout: float = 5.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(what)
