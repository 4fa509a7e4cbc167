"""The Kubernetes lab: a real control plane, lab nodes, pod agents and a service proxy.

    lab = Lab("/var/lib/kxlb/lab", proxy="kxlb")   # or "kube-proxy" or "none"
    lab.up()            # idempotent; blocks until nodes are Ready and the proxy is healthy
    lab.kubeconfig      # admin kubeconfig (kubectl, the Python client)
    lab.status()        # JSON-able
    lab.set_proxy("kube-proxy")
    lab.down()          # idempotent, also after a crash

Pieces (all named after ``name``, default ``kxlab``):

- the control plane of ``lab/controlplane.py`` in the work directory (loopback ports;
  ``port_offset`` shifts them all, for a second lab beside the first);
- the network of ``lab/nodes.py``: node namespaces, fabric, client, cgroups;
- one pod agent per node (``lab/podagent.py``), a background process;
- one proxy per node (``lab/proxies.py``: the modes, their command lines, health and
  clean-up; ``lab/proxyrun.py`` switches them): the kxlb controller (``python -m kxlb controller``, as a DaemonSet would run
  it: host network, the node's interfaces, the node's cgroup), the real kube-proxy
  (nftables or iptables mode) inside the node's namespace, or nothing.

Every process gets the environment marker ``KXLB_LAB=<workdir>`` and a pidfile in
``run/`` (``lab/supervisor.py``); ``down()`` stops both, with their process groups, so
nothing survives a crashed ``up``. Logs go to
``logs/`` in the work directory. ``lab.json`` records the configuration, for
``down``/``status``/``exec`` from another process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from . import controlplane as cpmod
from . import images, kubelet, pki, procs, proxies
from . import nodes as nodes_mod
from .controlplane import ControlPlane, ControlPlaneError, Ports
from .errors import LabError
from .nodes import LB_POOL, SERVICE_CIDR, SERVICE_CIDR6, NodeSpec, Topology, netns_exists
from .proxies import PROXIES, PROXY_MODES
from .proxyrun import ProxyRunner
from .supervisor import LAB_MARKER, Supervisor

SERVICE_CIDRS = f"{SERVICE_CIDR},{SERVICE_CIDR6}"

DEFAULT_WORKDIR = cpmod.DEFAULT_WORKDIR
MARKER_ENV = LAB_MARKER


# Which work directory owns a lab name (its namespaces, cgroups, pins): /run/kxlb-lab/<name>.json.
CLAIM_DIR = Path("/run/kxlb-lab")


class Lab:
    def __init__(self, workdir: os.PathLike | str = DEFAULT_WORKDIR, *, name: str = "kxlab", nodes: int = 2,
                 proxy: str = "kxlb", port_offset: int = 0, advertise_address: Optional[str] = None,
                 api_iface: Optional[str] = None, bin_dir: os.PathLike | str | None = None,
                 kubelet: bool = False, rp_filter: int = 0, node_port_range: Optional[str] = None,
                 masquerade_ports: Optional[str] = None, log: Optional[Callable[[str], None]] = None):
        if proxy not in PROXIES:
            raise ValueError(f"proxy must be one of {', '.join(PROXIES)}")
        for flag, val in (("node_port_range", node_port_range), ("masquerade_ports", masquerade_ports)):
            lo, dash, hi = (val or "1-1").partition("-")
            if not (dash and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi) <= 65535):
                raise ValueError(f"{flag} {val!r}: expected LO-HI, ports 1-65535")
        self.workdir = Path(workdir).resolve()
        self.name, self.nodes, self.proxy_requested = name, nodes, proxy
        self.port_offset = port_offset
        self.advertise_address = advertise_address or (
            "10.254.0.1" if port_offset == 0 else f"10.254.{(port_offset // 256) % 256}.{port_offset % 254 + 1}")
        self.api_iface = api_iface or ("kxlb-apisrv0" if name == "kxlab" else f"{name[:10]}-api0")
        self._bin_dir = Path(bin_dir) if bin_dir else None
        self.kubelet = kubelet   # real kubelet + containerd nodes (lab/kubelet.py), else pod agents
        # Node settings a cluster may have (docs/lab.md, "Options"): reverse-path filtering on
        # the nodes, the API server's NodePort range (kxlb's controller is given the same),
        # kxlb's masquerade ports (None: the controller chooses).
        self.node_port_range, self.masquerade_ports = node_port_range, masquerade_ports
        self.log = log or (lambda msg: print(f"lab: {msg}", file=sys.stderr, flush=True))
        self.topology = Topology(name, nodes, rp_filter=rp_filter)
        # The lab's own processes (the control plane's have theirs): run/lab-<role>.pid.
        self.sup = Supervisor(self.workdir, MARKER_ENV, error=LabError, prefix="lab-", log=self.log)

    # ---- configuration ---------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.workdir / "lab.json"

    def read_state(self) -> Optional[dict]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    @classmethod
    def from_workdir(cls, workdir: os.PathLike | str = DEFAULT_WORKDIR, **kw) -> "Lab":
        """The lab last brought up in *workdir* (defaults when there is none)."""
        wd = Path(workdir).resolve()
        try:
            st = json.loads((wd / "lab.json").read_text())
        except (OSError, ValueError):
            return cls(wd, **kw)
        args = dict(name=st["topology"]["name"], nodes=len(st["topology"]["nodes"]),
                    proxy=st.get("proxy_requested", "kxlb"), port_offset=st.get("port_offset", 0),
                    advertise_address=st.get("advertise_address"), api_iface=st.get("api_iface"),
                    bin_dir=st.get("bin_dir"), kubelet=st.get("runtime") == "kubelet",
                    **{k: v for k, v in (st.get("options") or {}).items()})
        args.update(kw)
        return cls(wd, **args)

    @property
    def controlplane(self) -> ControlPlane:
        extra = {cpmod.APISERVER: [f"--egress-selector-config-file={self.egress_selector}"]} if self.kubelet else {}
        return ControlPlane(self.workdir, self._bin_dir, ports=Ports().shifted(self.port_offset),
                            advertise_address=self.advertise_address, iface=self.api_iface,
                            service_cidr=SERVICE_CIDRS, node_port_range=self.node_port_range, extra_args=extra,
                            log=lambda m: self.log(f"controlplane: {m}"))

    # The API server's way into a kubelet lab, as a konnectivity server is on a cluster
    # whose control plane is off the pod network: its "cluster" traffic (kubelets for
    # exec, logs, port-forward; pods and Services for the proxy subresources) goes as
    # HTTP CONNECT to a unix socket, where the relay dials from the first node's
    # namespace, which routes to every node and pod. Nothing of the lab is routed
    # to the host for it.
    @property
    def egress_socket(self) -> Path:
        return self.workdir / "relay" / "cluster.sock"

    @property
    def egress_selector(self) -> Path:
        return self.workdir / "egress-selector.yaml"

    def _write_egress_selector(self) -> None:
        if len(str(self.egress_socket)) > 100:  # sun_path holds 108 bytes
            raise LabError(f"workdir {self.workdir}: too long for the unix socket {self.egress_socket}")
        self.egress_socket.parent.mkdir(parents=True, exist_ok=True)
        self.egress_selector.write_text(
            "apiVersion: apiserver.k8s.io/v1beta1\n"
            "kind: EgressSelectorConfiguration\n"
            "egressSelections:\n"
            "- name: cluster\n"
            "  connection:\n"
            "    proxyProtocol: HTTPConnect\n"
            "    transport:\n"
            "      uds:\n"
            f"        udsName: {self.egress_socket}\n")

    @property
    def bin_dir(self) -> Path:
        if self._bin_dir is None:
            self._bin_dir = cpmod.default_bin_dir()
        return self._bin_dir

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig" / "admin.kubeconfig"

    @property
    def kube_proxy_kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig" / "kube-proxy.kubeconfig"

    @property
    def api_port(self) -> int:
        return Ports().shifted(self.port_offset).apiserver

    @property
    def node_specs(self) -> list[NodeSpec]:
        return self.topology.node_specs

    def node(self, which: int | str) -> NodeSpec:
        """A node by index (1-based), name, or suffix (``node-2``)."""
        for n in self.node_specs:
            if which in (n.index, n.name, str(n.index), n.name.removeprefix(f"{self.name}-")):
                return n
        raise LabError(f"no node {which!r} in lab {self.name} ({', '.join(n.name for n in self.node_specs)})")

    @property
    def client_ns(self) -> str:
        return self.topology.client_ns

    @property
    def client_ip(self) -> str:
        return self.topology.client_ip

    @property
    def proxy(self) -> str:
        """The proxy that runs (kxlb may have fallen back to none)."""
        st = self.read_state() or {}
        return st.get("proxy", "none")

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise LabError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
        return r

    def api_client(self):
        """A new kubernetes.client.ApiClient for the admin kubeconfig (close it when done)."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    # ---- up ----------------------------------------------------------------------------------
    def up(self, *, build: bool = True, timeout: float = 180) -> "Lab":
        """Bring the lab up, or make sure it is; returns self. Raises LabError."""
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, cgroups, BPF)")
        t0 = time.monotonic()
        st = self.read_state()
        running = bool(st) and st.get("state") != "down"
        same = bool(st) and (st["topology"]["name"], len(st["topology"]["nodes"]), st.get("port_offset", 0),
                             st.get("runtime", "agent"), st.get("options") or {}) == \
            (self.name, self.nodes, self.port_offset, "kubelet" if self.kubelet else "agent", self.options)
        if running and not same and \
                ControlPlane.from_workdir(self.workdir).status(probe=False)["components"][cpmod.APISERVER]["running"]:
            opts = " ".join(f"{k}={v}" for k, v in (st.get("options") or {}).items())
            raise LabError(f"the lab in {self.workdir} runs as {st['topology']['name']} with "
                           f"{len(st['topology']['nodes'])} nodes{', ' + opts if opts else ''}; "
                           f"`kxlb lab down` first")
        if running and same and self._try_repair():
            self.log(f"already up ({self.workdir}); checked in {time.monotonic() - t0:.1f}s")
            return self
        if build and self._bin_dir is None:
            self._bin_dir = cpmod.ensure_binaries(log=self.log)
        missing = cpmod.missing_binaries(self.bin_dir) + [
            b for b in ("kubectl", "kube-proxy") if not os.access(self.bin_dir / b, os.X_OK)]
        if missing:
            raise LabError(f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run {cpmod.BUILD_SH}")
        if st and not same:  # what an earlier configuration left, under its own names
            Lab.from_workdir(self.workdir, log=self.log).down(quiet=True)
        self.down(quiet=True)
        try:
            self._fresh_up(timeout)
        except BaseException:
            self.log(f"up failed; logs stay in {self.workdir / 'logs'}; cleaning up")
            try:
                self.down(quiet=True)
            except Exception as exc:  # noqa: BLE001 - keep the original error
                self.log(f"cleanup failed too: {exc}")
            raise
        self._start_proxy(timeout)
        self.log(f"up in {time.monotonic() - t0:.1f}s; kubeconfig {self.kubeconfig}; proxy {self.proxy}")
        return self

    @property
    def options(self) -> dict:
        """The lab's options that differ from the defaults (lab.json "options")."""
        opts = {"rp_filter": self.topology.rp_filter, "node_port_range": self.node_port_range,
                "masquerade_ports": self.masquerade_ports}
        return {k: v for k, v in opts.items() if v}

    def _claim_path(self) -> Path:
        return CLAIM_DIR / f"{self.name}.json"

    def _owner(self) -> Optional[str]:
        """The other work directory whose lab of the same name is (or may be) running."""
        try:
            owner = json.loads(self._claim_path().read_text())["workdir"]
        except (OSError, ValueError, KeyError):
            return None
        if owner == str(self.workdir):
            return None
        try:
            st = json.loads((Path(owner) / "lab.json").read_text())
        except (OSError, ValueError):
            return None  # its work directory is gone: a stale claim
        return owner if st.get("state") != "down" and st["topology"]["name"] == self.name else None

    def _fresh_up(self, timeout: float) -> None:
        owner = self._owner()
        if owner:
            raise LabError(f"a lab named {self.name} runs from {owner}; `kxlb lab down --workdir {owner}` "
                           f"first, or use another name")
        self.workdir.mkdir(parents=True, exist_ok=True)
        CLAIM_DIR.mkdir(parents=True, exist_ok=True)
        pki.write_public(self._claim_path(), json.dumps({"workdir": str(self.workdir)}).encode())
        k8s_version = subprocess.run([str(self.bin_dir / "kube-apiserver"), "--version"], capture_output=True,
                                     text=True).stdout.split()[-1]
        self._write_state({"proxy": "none", "k8s_version": k8s_version, "state": "up"})
        if self.kubelet:
            self._write_egress_selector()
        try:
            self.controlplane.up()
        except ControlPlaneError as exc:
            raise LabError(str(exc)) from None
        t = time.monotonic()
        self.topology.create()
        self.log(f"network: {len(self.node_specs)} nodes, fabric, client in {time.monotonic() - t:.1f}s")
        if self.kubelet:
            self._start_kubelet_nodes(timeout)
        else:
            for n in self.node_specs:
                self._start_agent(n)
        self._wait_nodes(timeout)
        self._start_lbpool()

    def _start_lbpool(self) -> None:
        argv = [sys.executable, "-m", "kxlb.lab.lbpool", "--kubeconfig", str(self.kubeconfig), "--pool", LB_POOL]
        p = self.sup.spawn("lbpool", argv, "lbpool")
        self.log(f"load-balancer IP pool {LB_POOL} (pid {p.pid})")

    def _write_state(self, extra: dict) -> None:
        st = self.read_state() or {}
        st.update({
            "topology": self.topology.to_dict(),
            "workdir": str(self.workdir),
            "port_offset": self.port_offset,
            "advertise_address": self.advertise_address,
            "api_iface": self.api_iface,
            "api_port": self.api_port,
            "bin_dir": str(self.bin_dir),
            "admin_kubeconfig": str(self.kubeconfig),
            "kube_proxy_kubeconfig": str(self.kube_proxy_kubeconfig),
            "proxy_requested": self.proxy_requested,
            "runtime": "kubelet" if self.kubelet else "agent",
            "options": self.options,
        })
        st.setdefault("created_id", str(uuid.uuid4()))
        st.update(extra)
        pki.write_public(self.state_file, (json.dumps(st, indent=2) + "\n").encode())

    def _start_proxy(self, timeout: float) -> None:
        """set_proxy(requested); a proxy that fails leaves the lab up without one."""
        try:
            self.set_proxy(self.proxy_requested, timeout=timeout)
        except LabError as exc:
            raise LabError(f"{exc}\nThe lab stays up without a service proxy; after a fix: "
                           f"kxlb lab proxy --workdir {self.workdir} {self.proxy_requested}") from None

    def _try_repair(self) -> bool:
        """True if the running lab is (now) complete: control plane healthy, network intact;
        dead agents and proxies are restarted. False: it has to be rebuilt."""
        cp = self.controlplane
        if not cp.is_up():
            self.log("control plane not running/healthy: rebuilding the lab")
            return False
        problems = self.topology.problems()
        if problems:
            self.log(f"network incomplete ({'; '.join(problems)}): rebuilding the lab")
            return False
        for n in self.node_specs:
            dead = [r for r in self._node_roles(n) if not self.sup.read(r)]
            if dead and self.kubelet:
                self.log(f"{', '.join(dead)} not running: rebuilding the lab")
                return False
            if dead:
                self.log(f"pod agent of {n.name} not running: starting it")
                self._start_agent(n)
        self._wait_nodes(60)
        if not self.sup.read("lbpool"):
            self._start_lbpool()
        st = self.read_state() or {}
        want = self.proxy_requested
        def proxy_down(n: NodeSpec) -> bool:
            if self.kubelet:  # a DaemonSet's pod: its health endpoint on the node
                return not proxies.daemonset_health(want, n)[0]
            return not self.sup.read(f"proxy-{n.name}")
        if st.get("proxy") != want or (want != "none" and any(proxy_down(n) for n in self.node_specs)):
            self._start_proxy(120)
        return True

    # ---- pod agents ------------------------------------------------------------------------------
    def _start_agent(self, n: NodeSpec) -> None:
        argv = [sys.executable, "-m", "kxlb.lab.podagent", "--workdir", str(self.workdir), "--node", n.name]
        p = self.sup.spawn(f"agent-{n.name}", argv, f"agent-{n.name}")
        self.log(f"pod agent for {n.name} started (pid {p.pid}), log {self.sup.log_path(f'agent-{n.name}')}")

    def _wait_nodes(self, timeout: float) -> None:
        """Until every Node is Ready and carries no not-ready/unreachable taint."""
        from kubernetes import client
        deadline = time.monotonic() + timeout
        api = self.api_client()
        try:
            core = client.CoreV1Api(api)
            detail = "not checked yet"
            while True:
                for n in self.node_specs:
                    for role in self._node_roles(n):
                        if not self.sup.read(role):
                            logp = self.sup.log_path(role)
                            raise LabError(f"{role} exited; log {logp}:\n{procs.tail(logp)}")
                try:
                    nodes = {x["metadata"]["name"]: x for x in
                             json.loads(core.list_node(_preload_content=False, _request_timeout=5).data)["items"]}
                    bad = []
                    for n in self.node_specs:
                        obj = nodes.get(n.name)
                        if obj is None:
                            bad.append(f"{n.name}: not registered")
                            continue
                        ready = [c for c in obj["status"].get("conditions", []) if c["type"] == "Ready"]
                        if not ready or ready[0]["status"] != "True":
                            bad.append(f"{n.name}: not Ready")
                        taints = [t["key"] for t in obj["spec"].get("taints") or []
                                  if t["key"].startswith("node.kubernetes.io/")]
                        if taints:
                            bad.append(f"{n.name}: tainted {', '.join(taints)}")
                    if not bad:
                        return
                    detail = "; ".join(bad)
                except Exception as exc:  # noqa: BLE001
                    detail = f"API: {exc}"
                if time.monotonic() > deadline:
                    raise LabError(f"nodes not ready after {timeout:.0f}s: {detail} (node logs in "
                                   f"{self.workdir / 'logs'})")
                time.sleep(0.3)
        finally:
            api.close()

    def _node_roles(self, n: NodeSpec) -> list[str]:
        """The processes that make node *n* a node (pidfile roles; logs/<role>.log)."""
        if self.kubelet:
            return [f"holder-{n.name}", f"containerd-{n.name}", f"kubelet-{n.name}"]
        return [f"agent-{n.name}"]

    # ---- real-kubelet nodes ----------------------------------------------------------------------
    def kubelet_node(self, n: NodeSpec) -> kubelet.KubeletNode:
        return kubelet.KubeletNode(self.workdir, n, node_bin=self.node_bin_dir,
                                   cgroup2_root=self.topology.cgroup_root, api_port=self.api_port)

    @property
    def node_bin_dir(self) -> Path:
        st = self.read_state() or {}
        if st.get("node_bin_dir"):
            return Path(st["node_bin_dir"])
        return cpmod.ensure_binaries(node=True, log=self.log)

    def _start_kubelet_nodes(self, timeout: float) -> None:
        """containerd and a kubelet per node (``lab/kubelet.py``); returns once every
        kubelet runs (``_wait_nodes`` waits for Ready)."""
        t = time.monotonic()
        node_bin = cpmod.ensure_binaries(node=True, log=self.log)
        self._write_state({"node_bin_dir": str(node_bin)})
        imgs = kubelet.NodeImages.build(self.workdir / "images", node_bin)
        pause = images.build_pause(self.workdir / "images" / "build")
        cp = self.controlplane
        ca = pki.load(cp.pki_dir, "ca")
        nodes = [(n, self.kubelet_node(n)) for n in self.node_specs]
        maps = []
        api = f"-/127.0.0.1:{self.api_port}"
        for n in self.node_specs:
            # The API server's advertise address (the `kubernetes` Service's endpoint) is a
            # local address of every node too, relayed like 127.0.0.1: pods reach the API
            # server through the Service, as on a cluster whose nodes route to it.
            nodes_mod.ip_batch(n.netns, [f"addr add {self.advertise_address}/32 dev lo"])
            maps += [f"{n.netns}/127.0.0.1:{self.api_port}={api}",
                     f"{n.netns}/{self.advertise_address}:{self.api_port}={api}"]
        self.sup.spawn("relay", [sys.executable, "-m", "kxlb.lab.relay", *(f"--map={m}" for m in maps),
                                 f"--connect={self.egress_socket}={self.node_specs[0].netns}"], "relay")
        self._create_nodes([kn.node_object() for _, kn in nodes])
        for n, kn in nodes:
            kn.prepare(ca, sys.executable)
            holder = self.sup.spawn(f"holder-{n.name}", kn.holder_argv(pause), f"holder-{n.name}", cgroup=n.cgroup)
            kubelet.wait_for(f"the namespace holder of {n.name}", lambda: _entered(holder.pid, str(pause)), 10)
            self.sup.spawn(f"containerd-{n.name}", kn.containerd_argv(holder.pid), f"containerd-{n.name}",
                           cgroup=n.cgroup, extra_env=kn.containerd_env())
        for n, kn in nodes:
            kubelet.wait_for(f"containerd of {n.name}", kn.containerd_ready, 60,
                             lambda: procs.tail(self.sup.log_path(f"containerd-{n.name}")))
            kn.import_images(imgs)
            holder = self.sup.read(f"holder-{n.name}")
            self.sup.spawn(f"kubelet-{n.name}", kn.kubelet_argv(int(holder["pid"])), f"kubelet-{n.name}",
                           cgroup=n.cgroup)
        # Cluster DNS, as kubeadm deploys it; it answers once a service proxy runs (its
        # pods reach the API server through the `kubernetes` Service).
        self.kubectl("apply", "-f", str(kubelet.ADDONS / "coredns.yaml"))
        self.log(f"containerd and kubelet on {len(nodes)} nodes in {time.monotonic() - t:.1f}s; CoreDNS applied")

    def _create_nodes(self, objs: list[dict]) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException
        api = self.api_client()
        try:
            core = client.CoreV1Api(api)
            for obj in objs:
                try:
                    core.create_node(obj)
                except ApiException as exc:
                    if exc.status != 409:
                        raise LabError(f"creating Node {obj['metadata']['name']}: {exc.reason}: {exc.body}") from None
        finally:
            api.close()

    def restart_agent(self, which: int | str) -> None:
        n = self.node(which)
        self.sup.stop_roles([f"agent-{n.name}"], 5.0)
        self._start_agent(n)

    # ---- proxies (lab/proxyrun.py) ----------------------------------------------------------------
    @property
    def proxies(self) -> "ProxyRunner":
        return ProxyRunner(self)

    def set_proxy(self, mode: str, *, timeout: float = 120) -> str:
        """Stop the running proxy, clean up after it, start *mode* on every node and wait
        until it is healthy (lab/proxyrun.py). Returns the mode that runs."""
        return self.proxies.set(mode, timeout=timeout)

    def proxy_pid(self, which: int | str) -> Optional[int]:
        """The pid of the service proxy process running on a node (None: none runs)."""
        info = self.sup.read(f"proxy-{self.node(which).name}")
        return int(info["pid"]) if info else None

    # ---- down ------------------------------------------------------------------------------------
    def down(self, *, purge: bool = False, quiet: bool = False) -> None:
        """Stop every process, remove every namespace, interface, cgroup and pin of this lab.
        Idempotent; works after a crash (pidfiles, environment marker, name prefixes)."""
        t0 = time.monotonic()
        self.sup.stop_roles(self.sup.roles(), 5.0)
        self.sup.stop({p: None for p in self.sup.marked()}, 2.0)
        try:
            # As configured by its last up(): the interface and ports it really made.
            ControlPlane.from_workdir(self.workdir, log=lambda m: self.log(f"controlplane: {m}")).down()
        except ControlPlaneError as exc:
            raise LabError(str(exc)) from None
        removed: list[str] = []
        owner = self._owner()
        if owner:
            self.log(f"the namespaces, cgroups and pins named {self.name}-* belong to the lab in {owner}: "
                     f"left alone")
        else:
            removed = self.topology.destroy()
            # Pins of any node this lab ever had, also with another node count: after the
            # namespaces and cgroups (and the processes in them, a DaemonSet's controller
            # holding its pin directory's lock among them) are gone, with every
            # attachment. (A proxy switch removes kxlb through `kxlb cleanup` instead:
            # lab/proxies.py clear_bpf.)
            bpffs = self.topology.bpffs
            if os.path.isdir(bpffs):
                for d in os.listdir(bpffs):
                    if d.startswith(f"{self.name}-node-"):
                        shutil.rmtree(os.path.join(bpffs, d), ignore_errors=True)
            # The kubelets' cgroup v1 trees (lab/kubelet.py), under the same path.
            removed += kubelet.remove_v1_cgroups("/" + os.path.relpath(self.topology.cgroup_dir,
                                                                       self.topology.cgroup_root))
            self._claim_path().unlink(missing_ok=True)
        self.sup.stop({p: None for p in self.sup.marked()}, 2.0)
        shutil.rmtree(self.workdir / "nodes", ignore_errors=True)
        if self.read_state():
            self._write_state({"state": "down", "proxy": "none"})  # keeps the lab's identity for later commands
        if purge:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if not quiet or removed:
            self.log(f"down in {time.monotonic() - t0:.1f}s" + (f"; removed {len(removed)} namespaces/cgroups"
                                                                  if removed else ""))

    # ---- status ------------------------------------------------------------------------------------
    def status(self, *, probe: bool = True) -> dict:
        st = self.read_state()
        cp = self.controlplane.status(probe=probe) if st else None
        out = {
            "up": False, "workdir": str(self.workdir), "name": self.name,
            "kubeconfig": str(self.kubeconfig), "kube_proxy_kubeconfig": str(self.kube_proxy_kubeconfig),
            "server": f"https://127.0.0.1:{self.api_port}",
            "proxy": (st or {}).get("proxy"), "proxy_requested": (st or {}).get("proxy_requested"),
            "k8s_version": (st or {}).get("k8s_version"), "options": (st or {}).get("options") or {},
            "client": {"netns": self.client_ns, "ip": self.client_ip,
                       "present": netns_exists(self.client_ns),
                       "routes": self.topology.to_dict()["client"]["routes"]},
            "fabric": {"netns": self.topology.fabric_ns, "bridge": "br0", "cidr": "10.250.0.0/24",
                       "present": netns_exists(self.topology.fabric_ns)},
            "nodes": [], "controlplane": cp,
        }
        api_nodes: dict = {}
        if st and probe and cp and cp["up"]:
            try:
                from kubernetes import client
                api = self.api_client()
                try:
                    data = client.CoreV1Api(api).list_node(_preload_content=False, _request_timeout=5).data
                    api_nodes = {x["metadata"]["name"]: x for x in json.loads(data)["items"]}
                finally:
                    api.close()
            except Exception:  # noqa: BLE001
                api_nodes = {}
        healthy = bool(st) and (st or {}).get("state") != "down" and bool(cp and cp["up"])
        for n in self.node_specs:
            daemons = {r.removesuffix(f"-{n.name}"): self.sup.read(r) for r in self._node_roles(n)}
            agent = all(daemons.values())
            proxy = self.sup.read(f"proxy-{n.name}")
            obj = api_nodes.get(n.name)
            ready = None
            if obj is not None:
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in obj["status"].get("conditions", []))
            entry = {
                "name": n.name, "netns": n.netns, "present": netns_exists(n.netns),
                "internal_ip": n.ip, "addresses": {"InternalIP": n.ip, "pod_gateway": n.gateway},
                "pod_cidr": n.pod_cidr, "zone": n.zone, "cgroup": n.cgroup, "pin_dir": n.pin_dir,
                "pod_veth_glob": "kxp*", "ready": ready,
                "runtime": "kubelet" if self.kubelet else "agent",
                "daemons": {d: {"pid": info["pid"] if info else None, "running": bool(info),
                                "log": str(self.workdir / "logs" / f"{d}-{n.name}.log")}
                            for d, info in daemons.items()},
                "proxy": {"mode": (st or {}).get("proxy"), "pid": proxy["pid"] if proxy else None,
                          "running": bool(proxy), "log": proxy["log"] if proxy else None},
            }
            mode = (st or {}).get("proxy") or "none"
            kind = PROXY_MODES.get(mode, PROXY_MODES["none"]).kind
            if self.kubelet and kind != "none":
                entry["proxy"].update({"daemonset": f"kube-system/{proxies.daemonset_name(mode)}",
                                       "metrics": f"127.0.0.1:{proxies.DS_METRICS_PORT} (in {n.netns})",
                                       "healthz": f"127.0.0.1:{proxies.DS_HEALTHZ_PORT} (in {n.netns})"})
                # Without probing the pod's health is unknown: not counted against the lab.
                entry["proxy"]["running"] = proxies.daemonset_health(mode, n)[0] if probe else None
                proxy = entry["proxy"]["running"] is not False
            elif kind == "kxlb":
                entry["proxy"]["metrics"] = f"127.0.0.1:{proxies.CONTROLLER_METRICS_BASE + self.port_offset + n.index}"
            elif kind == "kube-proxy":
                entry["proxy"]["metrics"] = f"127.0.0.1:{proxies.KUBE_PROXY_METRICS_BASE + self.port_offset + n.index} (in {n.netns})"
                entry["proxy"]["healthz"] = f"127.0.0.1:{proxies.KUBE_PROXY_HEALTHZ_BASE + self.port_offset + n.index} (in {n.netns})"
            healthy = healthy and entry["present"] and bool(agent) and (ready is not False) and \
                ((st or {}).get("proxy") == "none" or bool(proxy))
            out["nodes"].append(entry)
        out["up"] = bool(healthy and out["client"]["present"])
        return out

    # ---- exec ------------------------------------------------------------------------------------
    def resolve_target(self, target: str) -> tuple[str, Optional[str]]:
        """``node/NAME``, ``client``, ``fabric`` or ``NAMESPACE/POD`` -> (netns, cgroup or None)."""
        if target == "client":
            return self.client_ns, None
        if target == "fabric":
            return self.topology.fabric_ns, None
        if target.startswith("node/"):
            n = self.node(target.split("/", 1)[1])
            return n.netns, n.cgroup
        if target.count("/") == 1:
            ns, name = target.split("/")
            for f in (self.workdir / "nodes").glob("*/pods/*.json"):
                try:
                    st = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if (st.get("namespace"), st.get("name")) == (ns, name):
                    if st.get("host_network"):
                        return st["netns"], self.node(st["node"]).cgroup
                    return st["netns"], None
            raise LabError(f"pod {target} is not running on a lab node")
        raise LabError(f"bad target {target!r}: node/NAME, client, fabric or NAMESPACE/POD")

    def exec_env(self) -> dict:
        env = self.sup.env({"KUBECONFIG": str(self.kubeconfig)})
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return env

    def exec_argv(self, target: str, argv: list[str]) -> tuple[list[str], Optional[str]]:
        ns, cg = self.resolve_target(target)
        if not netns_exists(ns):
            raise LabError(f"network namespace {ns} does not exist (is the lab up?)")
        return ["ip", "netns", "exec", ns, *argv], cg

    def run_in(self, target: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run a command in a target's namespace (and cgroup) and wait for it."""
        full, cg = self.exec_argv(target, argv)

        def preexec() -> None:
            if cg:
                with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                    f.write("0")

        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(full, env=self.exec_env(), preexec_fn=preexec, **kw)

    def exec(self, target: str, argv: list[str]) -> None:
        """Replace this process with *argv* in the target's namespace (and cgroup)."""
        full, cg = self.exec_argv(target, argv)
        if cg:
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        os.execvpe(full[0], full, self.exec_env())


def _entered(pid: int, exe: str) -> bool:
    """Has *pid* exec'd *exe* (the holder, after ``unshare``, ``nsenter`` and its mount
    script), in a mount namespace of its own?"""
    try:
        return os.readlink(f"/proc/{pid}/exe") == exe and \
            os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False
