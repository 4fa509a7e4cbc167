"""A throwaway Kubernetes control plane for the kxlb lab.

Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler as plain
processes on loopback (binaries from ``lab/k8s/build.sh``), with a fresh PKI and
kubeconfigs in a work directory::

    cp = ControlPlane("/var/lib/kxlb/lab")   # bin dir: lab/k8s/build.sh's cache
    cp.up()                                  # blocks until every component is ready
    cp.admin_kubeconfig                      # -> Path, for kubectl / the Python client
    cp.status()                              # -> dict (JSON-able)
    cp.down()                                # idempotent; also cleans up a crashed run

Layout of the work directory::

    state.json          config of the last up() (down()/status() from a new process read it)
    pki/                CA, serving and client certs, service-account keypair,
                        front-proxy (requestheader) CA and client cert
    kubeconfig/         admin.kubeconfig, controller-manager.kubeconfig, scheduler.kubeconfig
    etcd/               etcd data dir
    logs/<component>.log
    run/<component>.pid JSON: pid, process start time, argv

kube-apiserver serves on 127.0.0.1 (``apiserver_bind_address`` can widen that to
0.0.0.0 or the advertise address, e.g. for pods that reach it through the
``kubernetes`` Service), but always advertises a non-loopback address (the
``kubernetes`` Service's endpoint; loopback is not allowed there). That
address lives on an interface of its own in the host netns (a dummy interface,
or a port-less bridge where the kernel has no dummy driver): it is a local
address only, nothing is sent anywhere through it.

Every process is started in its own session (process group) with an environment
marker ``KXLB_CONTROLPLANE=<workdir>``; ``down()`` kills the groups from the
pidfiles *and* any process carrying the marker, so a run whose Python process
crashed (or whose pidfiles were lost) is still cleaned up.

Run as root (the interface). Needs the ``cryptography`` package and ``ip``
(iproute2); nothing else outside the standard library.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from . import components, pki, procs
from .components import APISERVER, COMPONENTS, CONTROLLER_MANAGER, ETCD, SCHEDULER
from .supervisor import CONTROLPLANE_MARKER, Supervisor

HERE = Path(__file__).resolve().parent
BUILD_SH = HERE / "k8s" / "build.sh"
DEFAULT_WORKDIR = Path(os.environ.get("KXLB_LAB_DIR", "/var/lib/kxlb/lab"))
MARKER_ENV = CONTROLPLANE_MARKER

BINARIES = (*COMPONENTS, "kubectl", "kube-proxy")


class ControlPlaneError(RuntimeError):
    """Start-up, readiness or teardown failure; the message names the component and log."""


@dataclass
class Ports:
    """Loopback ports. Defaults sit below the ephemeral range (32768+) and the
    NodePort range (30000-32767), away from the well-known Kubernetes ports."""

    etcd_client: int = 16379
    etcd_peer: int = 16380
    apiserver: int = 16443
    controller_manager: int = 16457
    scheduler: int = 16459

    def shifted(self, by: int) -> "Ports":
        return Ports(**{k: v + by for k, v in asdict(self).items()})

    def by_component(self) -> dict[str, list[int]]:
        return {
            ETCD: [self.etcd_client, self.etcd_peer],
            APISERVER: [self.apiserver],
            CONTROLLER_MANAGER: [self.controller_manager],
            SCHEDULER: [self.scheduler],
        }


@dataclass
class Timeouts:
    etcd: float = 60
    apiserver: float = 180
    controllers: float = 120   # controller-manager and scheduler healthz
    default_sa: float = 120    # the default ServiceAccount (pods can't be created before it)
    stop_grace: float = 15     # SIGTERM -> SIGKILL


# ----------------------------------------------------------------------------- binaries

def default_bin_dir() -> Path:
    """Where ``lab/k8s/build.sh`` puts (or would put) the binaries; no build.

    ``$KXLB_K8S_BIN_DIR`` overrides it.
    """
    env = os.environ.get("KXLB_K8S_BIN_DIR")
    if env:
        return Path(env)
    if not BUILD_SH.exists():
        raise ControlPlaneError(f"{BUILD_SH} not found; pass bin_dir or set KXLB_K8S_BIN_DIR")
    out = subprocess.run(["bash", str(BUILD_SH), "--print-bin-dir"], check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def ensure_binaries(*, timeout: Optional[float] = None, node: bool = False,
                    log: Optional[Callable[[str], None]] = None) -> Path:
    """Run ``lab/k8s/build.sh`` (``--node``: the real-kubelet nodes' set) and return the
    bin dir. A no-op when the cache is warm; a cold build of the control plane takes
    about 11 minutes on 2 cores. Build output goes to stderr. On *timeout* the whole
    build (its process group) is killed. ``$KXLB_K8S_BIN_DIR`` (``$KXLB_NODE_BIN_DIR``)
    overrides it."""
    env = os.environ.get("KXLB_NODE_BIN_DIR" if node else "KXLB_K8S_BIN_DIR")
    if env:
        return Path(env)
    argv = ["bash", str(BUILD_SH)] + (["--node"] if node else [])
    if log:
        log(f"running {' '.join(argv[1:])}")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise ControlPlaneError(f"{BUILD_SH} did not finish within {timeout:.0f}s; killed")
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    if p.returncode != 0:
        raise ControlPlaneError(f"{BUILD_SH} failed with exit code {p.returncode} (its output is above)")
    return Path(out.strip().splitlines()[-1])


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in COMPONENTS if not os.access(Path(bin_dir) / b, os.X_OK)]


def _port_busy(port: int, host: str = "127.0.0.1") -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        return True
    finally:
        s.close()
    return False


# ----------------------------------------------------------------------------- the control plane

class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    All arguments but *workdir* have lab defaults; two instances can run side by
    side with different workdirs, ``ports`` (see :meth:`Ports.shifted`),
    ``iface`` and ``advertise_address``.
    """

    def __init__(
        self,
        workdir: os.PathLike | str = DEFAULT_WORKDIR,
        bin_dir: os.PathLike | str | None = None,
        *,
        ports: Optional[Ports] = None,
        advertise_address: str = "10.254.0.1",
        apiserver_bind_address: str = "127.0.0.1",
        iface: str = "kxlb-apisrv0",
        service_cidr: str = "10.96.0.0/16",
        node_port_range: Optional[str] = None,
        cluster_name: str = "kxlb",
        controllers: str = "*,-nodeipam",
        extra_args: Optional[dict[str, list[str]]] = None,
        timeouts: Optional[Timeouts] = None,
        verbosity: int = 1,
        log: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self._bin_dir = Path(bin_dir) if bin_dir is not None else None
        self.ports = ports or Ports()
        self.advertise_address = advertise_address
        self.apiserver_bind_address = apiserver_bind_address
        self.iface = iface
        self.service_cidr = service_cidr
        self.node_port_range = node_port_range
        self.cluster_name = cluster_name
        self.controllers = controllers
        self.extra_args = extra_args or {}
        self.timeouts = timeouts or Timeouts()
        self.verbosity = verbosity
        self._log = log or (lambda msg: print(f"controlplane: {msg}", file=sys.stderr, flush=True))
        self.sup = Supervisor(self.workdir, MARKER_ENV, error=ControlPlaneError, fresh_logs=True, log=self._log)
        self._ssl: Optional[ssl.SSLContext] = None
        self._iface_made = False

        net = ipaddress.ip_network(service_cidr.split(",")[0])  # "v4" or "v4,v6" (dual-stack)
        self.kubernetes_service_ip = str(net.network_address + 1)
        adv = ipaddress.ip_address(advertise_address)
        if adv.is_loopback or adv.is_link_local or adv.is_unspecified:
            raise ValueError(f"advertise_address {advertise_address} must not be loopback/link-local")
        if apiserver_bind_address not in ("127.0.0.1", "0.0.0.0", advertise_address):
            raise ValueError("apiserver_bind_address must be 127.0.0.1, 0.0.0.0 or the advertise address")
        if len(iface) > 15:
            raise ValueError(f"interface name {iface!r} is longer than 15 characters")

    # ---- paths -----------------------------------------------------------------------------

    @property
    def bin_dir(self) -> Path:
        if self._bin_dir is None:
            self._bin_dir = default_bin_dir()
        return self._bin_dir

    pki_dir = property(lambda self: self.workdir / "pki")
    kubeconfig_dir = property(lambda self: self.workdir / "kubeconfig")
    logs_dir = property(lambda self: self.workdir / "logs")
    run_dir = property(lambda self: self.workdir / "run")
    etcd_dir = property(lambda self: self.workdir / "etcd")
    state_file = property(lambda self: self.workdir / "state.json")

    @property
    def admin_kubeconfig(self) -> Path:
        return self.kubeconfig_dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        """The URL clients on this host use."""
        return f"https://{self.apiserver_host}:{self.ports.apiserver}"

    @property
    def apiserver_host(self) -> str:
        """Where clients on this host reach the API server."""
        b = self.apiserver_bind_address
        return "127.0.0.1" if b == "0.0.0.0" else b

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.etcd_client}"

    def log_path(self, component: str) -> Path:
        return self.sup.log_path(component)

    @property
    def marker(self) -> str:
        return self.sup.marker

    # ---- public API --------------------------------------------------------------------------

    @classmethod
    def from_workdir(cls, workdir: os.PathLike | str = DEFAULT_WORKDIR, **kw) -> "ControlPlane":
        """An instance configured as the last ``up()`` in *workdir* (for down/status from a CLI)."""
        workdir = Path(workdir).resolve()
        try:
            st = json.loads((workdir / "state.json").read_text())
        except (OSError, ValueError):
            return cls(workdir, **kw)
        args = dict(
            bin_dir=st.get("bin_dir"),
            ports=Ports(**st["ports"]) if "ports" in st else None,
            advertise_address=st.get("advertise_address", "10.254.0.1"),
            apiserver_bind_address=st.get("apiserver_bind_address", "127.0.0.1"),
            iface=st.get("iface", "kxlb-apisrv0"),
            service_cidr=st.get("service_cidr", "10.96.0.0/16"),
            node_port_range=st.get("node_port_range"),
            cluster_name=st.get("cluster_name", "kxlb"),
            controllers=st.get("controllers", "*,-nodeipam"),
        )
        args.update(kw)
        return cls(workdir, **args)

    def up(self, *, keep_on_failure: bool = False) -> "ControlPlane":
        """Start everything and wait until it is ready. A no-op when the control
        plane of this workdir already runs and is healthy. Otherwise leftovers of
        an earlier run are killed and a fresh cluster (new PKI, empty etcd) starts.

        On failure everything started is stopped again (unless *keep_on_failure*)
        and :class:`ControlPlaneError` is raised; the logs stay in ``logs/``.
        """
        if os.geteuid() != 0:
            raise ControlPlaneError("the lab control plane needs root (it creates a network interface)")
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(
                f"missing binaries in {self.bin_dir}: {', '.join(missing)}; build them with {BUILD_SH}")
        if self.state_file.exists() and self.is_up():
            self._log(f"already up ({self.server}, workdir {self.workdir})")
            return self
        self._stop_processes()

        for comp, ports in self.ports.by_component().items():
            host = self.apiserver_bind_address if comp == APISERVER else "127.0.0.1"
            for port in ports:
                if _port_busy(port, host):
                    others = procs.marked(MARKER_ENV)
                    hint = ""
                    if others:
                        hint = "; kxlb control planes running: " + ", ".join(
                            f"pid {p} ({procs.exe_name(p)}) of workdir {w}" for p, w in sorted(others.items()))
                    raise ControlPlaneError(
                        f"{comp}: port {host}:{port} is already in use by another process "
                        f"(see `ss -ltnp 'sport = :{port}'`){hint}; stop it or choose other ports")

        t0 = time.monotonic()
        for d in (self.pki_dir, self.kubeconfig_dir, self.etcd_dir, self.run_dir):
            shutil.rmtree(d, ignore_errors=True)
        for d in (self.workdir, self.pki_dir, self.kubeconfig_dir, self.logs_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.etcd_dir.mkdir(mode=0o700)
        self._write_state()
        try:
            self._make_pki()
            self._iface_up()
            self._start(ETCD)
            self._wait(ETCD)
            self._start(APISERVER)
            self._wait(APISERVER)
            self._start(CONTROLLER_MANAGER)
            self._start(SCHEDULER)
            self._wait(CONTROLLER_MANAGER)
            self._wait(SCHEDULER)
            self._wait(CONTROLLER_MANAGER, lambda: components.probe_default_service_account(self),
                       self.timeouts.default_sa,
                       what="the default ServiceAccount (created by the serviceaccount controller)")
        except BaseException:
            if not keep_on_failure:
                try:
                    self._stop_processes()
                    self._iface_down()
                except Exception as e:  # keep the original error
                    self._log(f"cleanup after failed start-up failed too: {e}")
            raise
        self._log(f"up in {time.monotonic() - t0:.1f}s: {self.server}, kubeconfig {self.admin_kubeconfig}")
        return self

    def down(self, *, purge: bool = False) -> None:
        """Stop every process of this workdir's control plane and remove its
        interface. Idempotent; works from a fresh process and after a crash.
        *purge* also deletes the work directory."""
        self._stop_processes()
        self._iface_down()
        for comp in COMPONENTS:
            self.sup.pidfile(comp).unlink(missing_ok=True)
        if purge:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def is_up(self) -> bool:
        st = self.status(probe=True)
        return st["up"]

    def status(self, *, probe: bool = True) -> dict:
        """JSON-able status: per component pid/running/healthy/log, iface, paths."""
        comps = {}
        for comp in COMPONENTS:
            info = self.sup.read(comp)
            running = bool(info)
            healthy = None
            if probe and running:
                healthy = components.probe(self, comp)[0]
            comps[comp] = {
                "pid": info["pid"] if running else None,
                "running": running,
                "healthy": healthy,
                "log": str(self.log_path(comp)),
            }
        leftovers = [p for p in self.sup.marked() if p not in {c["pid"] for c in comps.values()}]
        return {
            "up": all(c["running"] and (c["healthy"] or not probe) for c in comps.values()),
            "workdir": str(self.workdir),
            "bin_dir": str(self._bin_dir) if self._bin_dir else None,
            "server": self.server,
            "admin_kubeconfig": str(self.admin_kubeconfig),
            "kubeconfigs": {p.stem: str(p) for p in sorted(self.kubeconfig_dir.glob("*.kubeconfig"))},
            "advertise_address": self.advertise_address,
            "iface": {"name": self.iface, "present": Path(f"/sys/class/net/{self.iface}").exists()},
            "service_cidr": self.service_cidr,
            "kubernetes_service_ip": self.kubernetes_service_ip,
            "ports": asdict(self.ports),
            "components": comps,
            "stray_pids": leftovers,
        }

    def kill(self, comp: str, sig: int = signal.SIGKILL, timeout: float = 15) -> Optional[int]:
        """Send *sig* to one component's process group (as a crash or an OOM kill would)
        and wait until it is gone; returns its pid (None if it was not running)."""
        if comp not in COMPONENTS:
            raise KeyError(comp)
        info = self.sup.read(comp)
        if not info:
            return None
        pid = info["pid"]
        try:
            os.killpg(pid, sig) if os.getpgid(pid) == pid else os.kill(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while procs.alive(pid, info.get("start")):
            self.sup.reap()
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{comp} (pid {pid}) still runs {timeout:g}s after signal {sig}")
            time.sleep(0.05)
        self.sup.reap()
        return pid

    def restart(self, comp: str) -> None:
        """Stop one component (SIGTERM, then SIGKILL) if it runs, start it again with the
        same configuration, and wait until it is ready."""
        if comp not in COMPONENTS:
            raise KeyError(comp)
        info = self.sup.read(comp)
        if info:
            self._stop_group({info["pid"]: info.get("start")})
        self._start(comp)
        self._wait(comp)

    def pids(self) -> list[int]:
        """Every live process of this control plane (pidfiles and marker)."""
        pids = set(self.sup.marked())
        for comp in COMPONENTS:
            info = self.sup.read(comp)
            if info:
                pids.add(info["pid"])
        return sorted(pids)

    # ---- state -------------------------------------------------------------------------------

    def _write_state(self) -> None:
        st = {
            "bin_dir": str(self.bin_dir),
            "ports": asdict(self.ports),
            "advertise_address": self.advertise_address,
            "apiserver_bind_address": self.apiserver_bind_address,
            "iface": self.iface,
            "service_cidr": self.service_cidr,
            "node_port_range": self.node_port_range,
            "cluster_name": self.cluster_name,
            "controllers": self.controllers,
            "created": time.time(),
        }
        pki.write_public(self.state_file, (json.dumps(st, indent=2) + "\n").encode())

    # ---- PKI and kubeconfigs -------------------------------------------------------------------

    def _make_pki(self) -> None:
        names = ["127.0.0.1", "localhost", self.kubernetes_service_ip, self.advertise_address,
                 "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"]
        pki.make_cluster(self.pki_dir, self.kubeconfig_dir, cluster=self.cluster_name, server=self.server,
                         apiserver_names=names)
        self._ssl = None

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context trusting the lab CA and presenting the admin client cert."""
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
            ctx.load_cert_chain(str(self.pki_dir / "admin-client.crt"), str(self.pki_dir / "admin-client.key"))
            self._ssl = ctx
        return self._ssl

    # ---- interface -----------------------------------------------------------------------------

    def _ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        ip = shutil.which("ip") or "/usr/sbin/ip"
        p = subprocess.run([ip, *args], capture_output=True, text=True)
        if check and p.returncode != 0:
            raise ControlPlaneError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")
        return p

    def _iface_up(self) -> None:
        name = self.iface
        self._iface_made = True
        if not Path(f"/sys/class/net/{name}").exists():
            p = self._ip("link", "add", name, "type", "dummy", check=False)
            if p.returncode != 0:
                # Kernels built without CONFIG_DUMMY: a bridge with no ports is as inert.
                self._ip("link", "add", name, "type", "bridge")
                self._log(f"no dummy driver ({p.stderr.strip()}); {name} is a port-less bridge")
        v6 = Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6")
        if v6.exists():
            v6.write_text("1\n")
        self._ip("addr", "flush", "dev", name)
        self._ip("addr", "add", f"{self.advertise_address}/32", "dev", name)
        self._ip("link", "set", name, "up")

    def _iface_down(self) -> None:
        # Only a workdir with a state file can have made the interface (the state is
        # written before it): a down() on some other, empty workdir must not remove
        # the interface of a lab that runs elsewhere under the same name.
        if not (self.state_file.exists() or self._iface_made):
            return
        if Path(f"/sys/class/net/{self.iface}").exists():
            self._ip("link", "del", self.iface)

    # ---- processes ---------------------------------------------------------------------------

    def _start(self, comp: str) -> None:
        try:
            proc = self.sup.spawn(comp, components.argv(self, comp))
        except OSError as e:
            raise ControlPlaneError(f"{comp}: cannot start {self.bin_dir / comp}: {e}") from e
        self._log(f"started {comp} (pid {proc.pid}), log {self.log_path(comp)}")

    def _wait(self, comp: str, probe: Optional[Callable[[], tuple[bool, str]]] = None,
              timeout: Optional[float] = None, what: Optional[str] = None) -> None:
        """Until *probe* (default: the component's readiness) passes, or *comp* exits."""
        what = what or comp
        probe = probe or (lambda: components.probe(self, comp))
        if timeout is None:
            timeout = {ETCD: self.timeouts.etcd, APISERVER: self.timeouts.apiserver}.get(comp, self.timeouts.controllers)
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        detail = "not probed yet"
        while True:
            code = self.sup.exit_code(comp)
            if code is not None:
                raise ControlPlaneError(
                    f"{comp} exited with code {code} while waiting for {what}; "
                    f"log: {self.log_path(comp)}\n--- last lines ---\n{procs.tail(self.log_path(comp))}")
            ok, detail = probe()
            if ok:
                self._log(f"{what} ready after {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() >= deadline:
                raise ControlPlaneError(
                    f"{what} not ready after {timeout:g}s (last check: {detail}); "
                    f"log: {self.log_path(comp)}\n--- last lines ---\n{procs.tail(self.log_path(comp))}")
            time.sleep(0.5)

    def _stop_processes(self) -> None:
        """Stop every process of this workdir: SIGTERM to its process group, SIGKILL
        after the grace time. In dependency order (scheduler and controller-manager,
        then kube-apiserver, then etcd): an apiserver whose etcd is gone hangs in
        its shutdown hooks. Processes found by the marker only go by their binary name."""
        targets: dict[int, tuple[str, Optional[int]]] = {}
        for comp in COMPONENTS:
            info = self.sup.read(comp)
            if info:
                targets[info["pid"]] = (comp, info.get("start"))
        for pid in self.sup.marked():
            if pid not in targets:
                targets[pid] = (procs.exe_name(pid), None)
        if not targets:
            self.sup.reap()
            return
        self._log("stopping " + ", ".join(f"{c} (pid {p})" for p, (c, _) in sorted(targets.items())))
        order = {SCHEDULER: 0, CONTROLLER_MANAGER: 0, APISERVER: 1, ETCD: 2}
        for phase in sorted(set(order.get(c, 3) for c, _ in targets.values())):
            group = {p: s for p, (c, s) in targets.items() if order.get(c, 3) == phase}
            self._stop_group(group)
        # Anything that appeared meanwhile (forked by one of them, or a racing start).
        for _ in range(3):
            stray = self.sup.marked()
            if not stray:
                break
            self._stop_group({p: None for p in stray})
        stray = self.sup.marked()
        if stray:
            raise ControlPlaneError(f"processes {stray} of {self.workdir} survive SIGKILL")

    def _stop_group(self, group: procs.Group) -> None:
        self.sup.stop(group, self.timeouts.stop_grace)


# ----------------------------------------------------------------------------- manual CLI

def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.controlplane",
                                 description="lab Kubernetes control plane on loopback")
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--workdir", default=str(DEFAULT_WORKDIR))
    ap.add_argument("--bin-dir", default=None, help="default: lab/k8s/build.sh's cache dir")
    ap.add_argument("--build", action="store_true", help="up: run lab/k8s/build.sh first")
    ap.add_argument("--purge", action="store_true", help="down: also delete the workdir")
    args = ap.parse_args(argv)
    try:
        if args.command == "up":
            bin_dir = args.bin_dir or (ensure_binaries() if args.build else None)
            cp = ControlPlane(args.workdir, bin_dir)
            cp.up()
            print(json.dumps(cp.status(), indent=2))
            print(f"\nexport KUBECONFIG={cp.admin_kubeconfig}", file=sys.stderr)
        elif args.command == "down":
            ControlPlane.from_workdir(args.workdir).down(purge=args.purge)
        else:
            st = ControlPlane.from_workdir(args.workdir).status()
            print(json.dumps(st, indent=2))
            return 0 if st["up"] else 3
    except ControlPlaneError as e:
        print(f"controlplane: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
