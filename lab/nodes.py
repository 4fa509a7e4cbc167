"""The lab's network: node namespaces joined through a fabric bridge, an external
client, per-pod namespaces with routed veths, and a cgroup v2 directory per node.

::

    kxlab-client (10.250.0.100) ─┐
    kxlab-node-1  eth0 10.250.0.11 ─┼─ br0 in kxlab-fabric  (10.250.0.0/24)
    kxlab-node-2  eth0 10.250.0.12 ─┘

    inside node i (podCIDR 10.244.i.0/24, no bridge, plain L3 routing):
      kxpXXXXXXXX  10.244.i.1/32 (the pods' gateway, the same on every pod veth)
          │ veth, route 10.244.i.x/32 dev kxpXXXXXXXX
      pod netns  eth0 10.244.i.x/32, default via 10.244.i.1 (covers the service CIDR)

Dual-stack: every address above has an IPv6 twin. The fabric is fd00:10:250::/64 (node
i: fd00:10:250::(10+i), hex; the client ::64), node i's podCIDR fd00:10:244:i::/64 with
pod 10.244.i.x at fd00:10:244:i::x and the gateway fd00:10:244:i::1/128 on every pod veth
(as IPv4's: so the node's own connections to a pod leave from it, and a masqueraded
packet shows another source than the node's InternalIP, as over IPv4), the service CIDR
fd00:10:96::/112. Duplicate
address detection and router solicitations are off: addresses work at once and no host
waits for a router advertisement that never comes.

Node i routes the other nodes' podCIDRs via their InternalIP, and the service CIDR,
the load-balancer pool and the externalIP range on-link through eth0 (a host-network
process needs *a* route to connect to a service address before a proxy translates it).
The client routes those three ranges via node 1, as a router in front of a cluster
would, and reaches NodePorts on the node addresses directly. Nothing has a default route, nothing is connected to the host's network
namespace: lab traffic cannot leave the machine.

Everything is named after the lab's *name* (default ``kxlab``), so two labs with
different names can exist side by side, and ``destroy()`` finds every namespace of a
lab by its prefix, also after a crash.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kxlb.loader import mounts
from kxlb.loader.netns import netns, netns_path

FABRIC_CIDR = "10.250.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
FABRIC_CIDR6 = "fd00:10:250::/64"
CLUSTER_CIDR6 = "fd00:10:244::/56"
SERVICE_CIDR6 = "fd00:10:96::/112"   # the API server allows at most a /108 of IPv6 cluster IPs
LB_POOL = "10.250.100.0/24"          # load-balancer IPs (lab/lbpool.py assigns them)
EXTERNAL_IP_RANGE = "10.250.200.0/24"  # for spec.externalIPs in tests and the demo
# What the client (a router's view of the cluster) sends via node 1.
CLIENT_ROUTES = (SERVICE_CIDR, LB_POOL, EXTERNAL_IP_RANGE)
CLIENT_ROUTES6 = (SERVICE_CIDR6,)
CLIENT_HOST = 100          # 10.250.0.100
NODE_HOST_BASE = 10        # node i: 10.250.0.(10+i)
POD_VETH_PREFIX = "kxp"    # the controller attaches to eth0 and kxp*


class LabNetError(RuntimeError):
    pass


def run(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise LabNetError(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def ip_batch(ns: str | None, commands: list[str]) -> None:
    """Several `ip` commands in one process (``ip -n NS -batch -``). *ns* is a name as
    `ip netns` knows it, a path to a namespace file (what a CNI runtime passes), or
    None for the caller's own namespace."""
    if ns and "/" in ns:
        argv = ["nsenter", f"--net={ns}", "ip", "-batch", "-"]
    else:
        argv = ["ip"] + (["-n", ns] if ns else []) + ["-batch", "-"]
    run(*argv, input="\n".join(commands) + "\n")


def wire_pod(node: NodeSpec, node_ns: str | None, pod_ns: str, veth: str, ip: str,
             ip6: str | None = None, ifname: str = "eth0") -> None:
    """The routed veth of one pod: *veth* in the node's namespace (the pods' gateway
    address on it, a host route to the pod), *ifname* in *pod_ns* (the pod's address,
    the default route via the gateway). The one layout of both pod runtimes: the pod
    agent and the CNI plugin (``lab/cni.py``). *node_ns* None: the caller's namespace."""
    sysctl(pod_ns, IPV6 if ip6 else NO_IPV6)
    ip_batch(node_ns, [
        f"link add {veth} type veth peer name {ifname} netns {netns_path(pod_ns)}",
        f"addr add {node.gateway}/32 dev {veth}",
        f"link set {veth} up",
        f"route replace {ip}/32 dev {veth}",
    ] + ([f"addr add {node.gateway6}/128 dev {veth} nodad", f"route replace {ip6}/128 dev {veth}"]
         if ip6 else []))
    ip_batch(pod_ns, [
        "link set lo up",
        f"addr add {ip}/32 dev {ifname}",
        f"link set {ifname} up",
        f"route add {node.gateway} dev {ifname} scope link",
        f"route add default via {node.gateway} dev {ifname}",
    ] + ([f"addr add {ip6}/128 dev {ifname} nodad", f"route add {node.gateway6} dev {ifname}",
          f"route add default via {node.gateway6} dev {ifname}"] if ip6 else []))


def netns_list() -> list[str]:
    try:
        return sorted(os.listdir("/var/run/netns"))
    except FileNotFoundError:
        return []


def netns_exists(name: str) -> bool:
    return os.path.exists(f"/var/run/netns/{name}")


def sysctl(ns: str | None, values: dict[str, str]) -> None:
    """Write sysctls as seen from *ns* (/proc/sys/net follows the writing thread's netns)."""
    with netns(ns):
        for key, val in values.items():
            path = "/proc/sys/" + key.replace(".", "/")
            try:
                with open(path, "w") as f:
                    f.write(val)
            except FileNotFoundError:
                if "ipv6" not in key:  # a kernel without IPv6: nothing to disable
                    raise


def set_node_conf(ns: str, values: dict[str, int]) -> None:
    """net.ipv4.conf.{all,default,<every interface>}.NAME = value in namespace *ns*."""
    with netns(ns):
        keys = sorted(os.listdir("/proc/sys/net/ipv4/conf"), key=lambda k: (k not in ("all", "default"), k))
        for key in keys:
            for name, val in values.items():
                try:
                    with open(f"/proc/sys/net/ipv4/conf/{key}/{name}", "w") as f:
                        f.write(str(val))
                except FileNotFoundError:
                    pass  # an interface gone meanwhile (a pod's veth)


def node_conf(ns: str, name: str) -> dict[str, int]:
    """net.ipv4.conf.*.NAME in namespace *ns*: {"all": v, "default": v, iface: v, ...}."""
    out = {}
    with netns(ns):
        for key in os.listdir("/proc/sys/net/ipv4/conf"):
            try:
                with open(f"/proc/sys/net/ipv4/conf/{key}/{name}") as f:
                    out[key] = int(f.read())
            except FileNotFoundError:
                pass
    return out


NO_IPV6 = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
IPV6 = {"net.ipv6.conf.all.disable_ipv6": "0", "net.ipv6.conf.default.disable_ipv6": "0",
        "net.ipv6.conf.all.accept_dad": "0", "net.ipv6.conf.default.accept_dad": "0",
        "net.ipv6.conf.all.router_solicitations": "0", "net.ipv6.conf.default.router_solicitations": "0"}
ROUTER = {
    "net.ipv4.ip_forward": "1",
    # rp_filter: Topology.rp_filter, set once the node's interfaces exist (reset_node_conf).
    # node 1 forwards the client's service traffic back out of eth0 to another node:
    # an ICMP redirect would teach the client to bypass it.
    "net.ipv4.conf.all.send_redirects": "0", "net.ipv4.conf.default.send_redirects": "0",
    "net.ipv6.conf.all.forwarding": "1",
}


def cgroup2_root() -> str:
    """The cgroup v2 mount point (the unified hierarchy of a hybrid system, or /sys/fs/cgroup),
    as kxlb's loader finds it; KXLB_CGROUP2_ROOT overrides it."""
    found = os.environ.get("KXLB_CGROUP2_ROOT") or mounts.cgroup2_root()
    if not found:
        raise LabNetError("no cgroup v2 hierarchy is mounted (needed for the nodes' host-network cgroups)")
    return found


@dataclass(frozen=True)
class NodeSpec:
    name: str        # Kubernetes Node name == network namespace name
    index: int       # 1-based
    ip: str          # InternalIP on the fabric
    pod_cidr: str
    gateway: str     # first address of the podCIDR, on the node side of every pod veth
    cgroup: str      # cgroup v2 dir for the node's host-network processes
    pin_dir: str     # bpffs dir for the node's datapath
    zone: str
    ip6: str = ""        # IPv6 InternalIP on the fabric
    pod_cidr6: str = ""  # IPv6 podCIDR

    @property
    def gateway6(self) -> str:
        return str(ipaddress.ip_network(self.pod_cidr6).network_address + 1)

    def pod_ip6(self, ip: str) -> str:
        """The IPv6 twin of a pod's IPv4 address (the same host number)."""
        host = int(ipaddress.ip_address(ip)) - int(ipaddress.ip_network(self.pod_cidr).network_address)
        return str(ipaddress.ip_network(self.pod_cidr6).network_address + host)

    @property
    def netns(self) -> str:
        return self.name


@dataclass
class Topology:
    name: str = "kxlab"
    nodes: int = 2
    cgroup_root: str = field(default_factory=cgroup2_root)
    bpffs: str = "/sys/fs/bpf"
    # Reverse-path filtering on the nodes (net.ipv4.conf.*.rp_filter): 0 off (the lab's
    # default), 1 strict (CIS benchmarks, kind), 2 loose. Set on all, default and every
    # interface of every node, so a pod's veth made later is born with it.
    rp_filter: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 50:
            raise ValueError("1 to 50 nodes")
        if self.rp_filter not in (0, 1, 2):
            raise ValueError(f"rp_filter {self.rp_filter!r}: 0 (off), 1 (strict) or 2 (loose)")
        if len(self.fabric_ns) > 64 or not self.name.replace("-", "").isalnum():
            raise ValueError(f"bad lab name {self.name!r}")

    # ---- names and addresses ------------------------------------------------------------
    @property
    def fabric_ns(self) -> str:
        return f"{self.name}-fabric"

    @property
    def client_ns(self) -> str:
        return f"{self.name}-client"

    @property
    def client_ip(self) -> str:
        return str(ipaddress.ip_network(FABRIC_CIDR).network_address + CLIENT_HOST)

    @property
    def client_ip6(self) -> str:
        return str(ipaddress.ip_network(FABRIC_CIDR6).network_address + CLIENT_HOST)

    @property
    def cgroup_dir(self) -> str:
        return os.path.join(self.cgroup_root, self.name)

    def node(self, i: int) -> NodeSpec:
        name = f"{self.name}-node-{i}"
        cidr = ipaddress.ip_network(CLUSTER_CIDR)
        pod_cidr = ipaddress.ip_network(f"{cidr.network_address + (i << 8)}/24")
        pod_cidr6 = ipaddress.ip_network(f"{ipaddress.ip_network(CLUSTER_CIDR6).network_address + (i << 64)}/64")
        return NodeSpec(
            name=name, index=i,
            ip=str(ipaddress.ip_network(FABRIC_CIDR).network_address + NODE_HOST_BASE + i),
            pod_cidr=str(pod_cidr), gateway=str(pod_cidr.network_address + 1),
            cgroup=os.path.join(self.cgroup_dir, name), pin_dir=os.path.join(self.bpffs, name),
            zone=f"zone-{i}",
            ip6=str(ipaddress.ip_network(FABRIC_CIDR6).network_address + NODE_HOST_BASE + i),
            pod_cidr6=str(pod_cidr6),
        )

    @property
    def node_specs(self) -> list[NodeSpec]:
        return [self.node(i) for i in range(1, self.nodes + 1)]

    def pod_netns(self, uid: str) -> str:
        return f"{self.name}-pod-{uid.replace('-', '')[:8]}"

    @staticmethod
    def pod_veth(uid: str) -> str:
        return f"{POD_VETH_PREFIX}{uid.replace('-', '')[:8]}"

    def owned_netns(self) -> list[str]:
        return [n for n in netns_list() if n.startswith(f"{self.name}-")]

    def to_dict(self) -> dict:
        return {
            "name": self.name, "fabric_netns": self.fabric_ns,
            "client": {"netns": self.client_ns, "ip": self.client_ip, "ip6": self.client_ip6,
                       "routes": [f"{r} via {self.node(1).ip}" for r in CLIENT_ROUTES]
                       + [f"{r} via {self.node(1).ip6}" for r in CLIENT_ROUTES6]},
            "nodes": [asdict(n) | {"netns": n.netns} for n in self.node_specs],
            "cgroup_root": self.cgroup_root, "fabric_cidr": FABRIC_CIDR, "cluster_cidr": CLUSTER_CIDR,
            "service_cidr": SERVICE_CIDR, "fabric_cidr6": FABRIC_CIDR6, "cluster_cidr6": CLUSTER_CIDR6,
            "service_cidr6": SERVICE_CIDR6, "rp_filter": self.rp_filter,
        }

    # ---- create / check / destroy ---------------------------------------------------------
    def create(self) -> None:
        """Build the fabric, the nodes, the client and the nodes' cgroups. Expects none of
        them to exist (call ``destroy()`` first)."""
        f = self.fabric_ns
        self._add_ns(f, ipv6=False)  # the bridge's namespace has no address of its own
        ip_batch(f, ["link add br0 type bridge stp_state 0 mcast_snooping 0", "link set br0 up"])
        prefix, prefix6 = ipaddress.ip_network(FABRIC_CIDR).prefixlen, ipaddress.ip_network(FABRIC_CIDR6).prefixlen
        for n in self.node_specs:
            self._add_ns(n.netns, ROUTER)
            self._fabric_port(f"port{n.index}", n.netns, f"{n.ip}/{prefix}", f"{n.ip6}/{prefix6}")
        for n in self.node_specs:
            routes = [f"route add {o.pod_cidr} via {o.ip} dev eth0" for o in self.node_specs if o != n]
            routes += [f"route add {o.pod_cidr6} via {o.ip6} dev eth0" for o in self.node_specs if o != n]
            routes += [f"route add {r} dev eth0" for r in CLIENT_ROUTES + CLIENT_ROUTES6]
            ip_batch(n.netns, routes)
        self._add_ns(self.client_ns, {"net.ipv4.conf.all.accept_redirects": "0",
                                      "net.ipv4.conf.default.accept_redirects": "0",
                                      "net.ipv6.conf.all.accept_redirects": "0",
                                      "net.ipv6.conf.default.accept_redirects": "0"})
        self._fabric_port("portc", self.client_ns, f"{self.client_ip}/{prefix}", f"{self.client_ip6}/{prefix6}")
        ip_batch(self.client_ns, [f"route add {r} via {self.node(1).ip} dev eth0" for r in CLIENT_ROUTES]
                 + [f"route add {r} via {self.node(1).ip6} dev eth0" for r in CLIENT_ROUTES6])
        for n in self.node_specs:
            self.reset_node_conf(n)
            os.makedirs(n.cgroup, exist_ok=True)

    def reset_node_conf(self, n: NodeSpec) -> None:
        """The lab's per-interface IPv4 settings on node *n*: rp_filter as configured on
        all, default and every interface, accept_local off. At creation, and after a
        proxy leaves (kxlb makes the devices it hooks loose and accept_local: a
        kube-proxy after it must meet the node as configured)."""
        set_node_conf(n.netns, {"rp_filter": self.rp_filter, "accept_local": 0})

    def _add_ns(self, ns: str, extra: dict[str, str] | None = None, ipv6: bool = True) -> None:
        run("ip", "netns", "add", ns)
        sysctl(ns, (IPV6 if ipv6 else NO_IPV6) | (extra or {}))
        ip_batch(ns, ["link set lo up"])

    def _fabric_port(self, port: str, ns: str, addr: str, addr6: str) -> None:
        ip_batch(self.fabric_ns, [f"link add {port} type veth peer name eth0 netns {ns}",
                                  f"link set {port} master br0", f"link set {port} up"])
        ip_batch(ns, [f"addr add {addr} dev eth0", f"addr add {addr6} dev eth0 nodad", "link set eth0 up"])

    def problems(self) -> list[str]:
        """What is missing from a built topology (empty list: intact)."""
        out = []
        have = set(netns_list())
        for ns in [self.fabric_ns, self.client_ns] + [n.netns for n in self.node_specs]:
            if ns not in have:
                out.append(f"network namespace {ns} is missing")
        for n in self.node_specs:
            if n.netns in have and run("ip", "-n", n.netns, "link", "show", "eth0", check=False).returncode:
                out.append(f"{n.netns}: eth0 is missing")
            if not os.path.isdir(n.cgroup):
                out.append(f"cgroup {n.cgroup} is missing")
        return out

    def destroy(self) -> list[str]:
        """Remove every namespace whose name starts with the lab's prefix (nodes, fabric,
        client, pods), the nodes' cgroups (killing what still runs in them). Idempotent."""
        removed = []
        for n in self.node_specs_from_disk():
            if os.path.isdir(n):
                kill_cgroup(n)
                removed.append(n)
        if os.path.isdir(self.cgroup_dir):
            kill_cgroup(self.cgroup_dir)
            removed.append(self.cgroup_dir)
        for ns in self.owned_netns():
            run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
        return removed

    def node_specs_from_disk(self) -> list[str]:
        """Cgroup dirs of this lab's nodes, whatever the node count of the run that made them."""
        try:
            return [os.path.join(self.cgroup_dir, d) for d in sorted(os.listdir(self.cgroup_dir))
                    if os.path.isdir(os.path.join(self.cgroup_dir, d))]
        except FileNotFoundError:
            return []

    # ---- pods --------------------------------------------------------------------------------
    def add_pod(self, node: NodeSpec, uid: str, ip: str, ip6: str | None = None) -> tuple[str, str]:
        """A pod's netns and routed veth (IPv6 too with ``ip6``); returns (netns, node-side
        veth). Replaces leftovers."""
        ns, veth = self.pod_netns(uid), self.pod_veth(uid)
        self.del_pod(node, uid)
        run("ip", "netns", "add", ns)
        try:
            wire_pod(node, node.netns, ns, veth, ip, ip6)
        except BaseException:
            self.del_pod(node, uid)
            raise
        return ns, veth

    def del_pod(self, node: NodeSpec, uid: str) -> None:
        ns, veth = self.pod_netns(uid), self.pod_veth(uid)
        if netns_exists(node.netns):
            run("ip", "-n", node.netns, "link", "del", veth, check=False)
        if netns_exists(ns):
            run("ip", "netns", "del", ns, check=False)


def kill_cgroup(path: str, timeout: float = 5.0) -> None:
    """Kill every process in cgroup *path* and its children, then remove the dirs.

    On cgroup2 ``cgroup.kill`` kills the whole subtree at once, forks in flight
    included, so a kubelet or containerd in the node's cgroup cannot start a
    container in a pod cgroup already emptied. A killed task leaves
    cgroup.procs before its cgroup stops being busy, and rmdir says EBUSY until
    then: each pass kills what is listed and removes what it can, bottom up, and
    passes repeat until the tree is gone or *timeout* runs out.
    """
    deadline = time.monotonic() + timeout
    while os.path.isdir(path):
        kill = Path(path) / "cgroup.kill"
        if kill.exists():  # not in v1 hierarchies, nor before Linux 5.14: SIGKILL below
            try:
                kill.write_text("1")
            except FileNotFoundError:
                pass  # removed meanwhile
        busy: list[tuple[str, list[int]]] = []
        for root, _dirs, _files in os.walk(path, topdown=False):
            try:
                pids = [int(p) for p in (Path(root) / "cgroup.procs").read_text().split()]
            except FileNotFoundError:
                continue  # removed meanwhile
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(root)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy.append((root, pids))
        if not busy:
            return
        if time.monotonic() > deadline:
            root, pids = busy[0]
            what = f"processes {pids} survive SIGKILL" if pids else "stays busy"
            raise LabNetError(f"cgroup {root}: {what} after {timeout:.0f}s")
        time.sleep(0.05)
