"""kxlb on a real kind cluster, made on this machine (``make kind``; ``python -m kxlb.lab.kind
up|down|status|kubeconfig``; docs/kind.md).

kind needs Docker and a node image; here neither may come from a registry, and the host's
firewall and forwarding must stay as they are. So:

- **Docker** is Debian's docker.io (scripts/setup-kind.sh installs it without starting it),
  run by ``Docker`` as a dockerd of its own: its own data root, socket and exec root, no
  iptables rules, no forwarding, no masquerade, no docker0. kind's nodes share one bridge
  and route among themselves; the host keeps its FORWARD policy and ``ip_forward``. Its
  default runtime is lab/kindnode/runc-bounded (Debian's runc, the containers'
  capabilities cut to this host's bounding set, which may lack CAP_SYS_RESOURCE).
- **The node image** (``NodeImage``) is built as kind's own recipe builds it (kind's
  ``build node-image`` pulls its base and images, so it cannot run offline): a Debian 12
  root file system from mmdebstrap, kind's base files from the kind module, the lab's
  containerd, kubelet, kubeadm and kubectl (lab/k8s/build.sh), and the images kubeadm and
  the e2e suite run, made by lab/images.py from the same binaries. Cached by its inputs.
- **The cluster** is ``kind create cluster --config deploy/kind-config.yaml`` (the user's
  file) with this node image, and one setting more: no default CNI (kindnetd's image comes
  from a registry). ``KindCluster.cni`` gives each node the ptp and host-local plugins
  with its pod CIDR and a route to every other node's, which is what kindnetd sets up.
- **kxlb** is the lab's image (lab/imagebuild.py: deploy/Dockerfile, the same image as
  the lab's), loaded with ``kind load image-archive``, and ``deploy/kxlb.yaml`` applied
  unchanged.

``down`` deletes the cluster and stops dockerd: no bridge, mount or process stays; the
data root keeps the images for the next ``up`` (warm: a minute or two).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from . import images, procs
from .controlplane import BUILD_SH
from .errors import LabError
from .imagebuild import ImageBuild, ImageError, content_digest, debian_rootfs
from .kubelet import NodeImages

REPO = Path(__file__).resolve().parent.parent
NODE_DIR = Path(__file__).resolve().parent / "kindnode"
RUNC_BOUNDED = NODE_DIR / "runc-bounded"
KIND_CONFIG = REPO / "deploy" / "kind-config.yaml"
MANIFEST = REPO / "deploy" / "kxlb.yaml"
# deploy/kxlb.yaml's kubeconfig names kind's default cluster's control plane
# (kind-control-plane): the manifest applies unchanged only to a cluster named "kind".
CLUSTER = "kind"
STATE_DIR = Path("/var/lib/kxlb/kind-docker")   # dockerd's data root: images, the nodes' disks
RUN_DIR = Path("/run/kxlb-kind")                # socket, pid, exec root, logs, kubeconfig
MARKER_ENV = "KXLB_KIND"                        # on dockerd and what it starts (containerd, shims)
DOCKERD, DOCKER = "/usr/sbin/dockerd", "/usr/bin/docker"   # Debian's docker.io: CLI and daemon of one release

# The node's packages: kind's base image's (images/base/Dockerfile), less NFS, iSCSI and
# e2fsprogs (no storage here), plus Debian's runc and CNI plugins, which kind builds.
NODE_PACKAGES = ("systemd", "dbus", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux",
                 "mount", "kmod", "libseccomp2", "pigz", "fuse-overlayfs", "bash", "ca-certificates", "curl",
                 "jq", "procps", "runc", "containernetworking-plugins", "iputils-ping", "socat")
# kind's containerd config names this sandbox image; kubeadm's is images.PAUSE_IMAGE.
KIND_PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# The Docker network kind puts its nodes on. Made here before kind runs (kind uses a network
# of that name as it finds it), with a bridge name of ours: a crashed dockerd leaves its
# bridges on the host, and this one is then found and deleted by name. IPv4 only, as the
# cluster (kind's own would add an IPv6 ULA subnet), and no masquerade.
KIND_NETWORK, KIND_BRIDGE = "kind", "kxlb-kind0"


class KindError(LabError):
    """A kind lab step failed; the message names the step and its log."""


def cache_dir() -> Path:
    return Path(os.environ.get("KXLB_CACHE", "/var/cache/kxlb")) / "kind"


def _run(argv: list[str], what: str, *, env: Optional[dict] = None, stdin=None, input: Optional[str] = None,
         timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, env=env, stdin=stdin, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise KindError(f"{what}: no answer in {timeout:.0f}s ({' '.join(argv[:6])} ...)") from None
    if check and r.returncode:
        raise KindError(f"{what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-3000:]}")
    return r


# ---- the binaries ----------------------------------------------------------------------------
class Bins:
    """The lab's binaries (lab/k8s/build.sh, built on first use): the control plane's
    (kube-apiserver, ..., etcd, kubectl), the node's (kubelet, containerd, coredns, agnhost)
    and kind's (kind, kubeadm)."""

    def __init__(self, log: Callable[[str], None] = print):
        self.control, self.node, self.kind = (self._build(t, log) for t in ("", "--node", "--kind"))
        versions = _run(["bash", str(BUILD_SH), "--versions"], "build.sh --versions").stdout
        self.versions = dict(line.split("=", 1) for line in versions.split())

    @staticmethod
    def _build(target: str, log) -> Path:
        r = subprocess.run(["bash", str(BUILD_SH), *([target] if target else [])], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        if r.returncode:
            raise KindError(f"lab/k8s/build.sh {target}: {r.stderr.strip()[-2000:]}")
        return Path(r.stdout.strip().splitlines()[-1])

    @property
    def k8s_version(self) -> str:
        return self.versions["K8S_VERSION"]

    def stamp(self) -> bytes:
        """What the binaries are: their sets' BUILD-OK records (versions, Go, build time)."""
        return b"".join((d.parent / "BUILD-OK").read_bytes() for d in (self.control, self.node, self.kind))


# ---- dockerd ---------------------------------------------------------------------------------
class Docker:
    """The kind lab's own dockerd: its own data root, socket and exec root, and nothing of
    the host's network touched (no iptables or ip6tables rules, no ip_forward, no
    masquerade, no default bridge)."""

    sock = RUN_DIR / "docker.sock"
    pidfile = RUN_DIR / "docker.pid"
    logfile = RUN_DIR / "dockerd.log"

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log

    @property
    def env(self) -> dict:
        # /usr/bin first: kind runs `docker`, which must be the CLI of this dockerd's release.
        return {**os.environ, "DOCKER_HOST": f"unix://{self.sock}",
                "PATH": "/usr/bin:/usr/sbin:" + os.environ.get("PATH", "/bin")}

    def __call__(self, *args: str, what: str = "", timeout: float = 600, stdin=None, input: Optional[str] = None,
                 check: bool = True) -> subprocess.CompletedProcess:
        return _run([DOCKER, *args], what or f"docker {' '.join(args[:3])}", env=self.env, stdin=stdin,
                    input=input, timeout=timeout, check=check)

    def pids(self) -> list[int]:
        return procs.marked_pids(MARKER_ENV, str(RUN_DIR))

    def answers(self) -> bool:
        return self.sock.exists() and self("version", "--format", "{{.Server.Version}}", check=False,
                                           timeout=20).returncode == 0

    def start(self) -> None:
        if self.pids() and self.answers():
            return
        if not os.access(DOCKERD, os.X_OK):
            raise KindError(f"{DOCKERD} is missing: run scripts/setup-kind.sh (Debian's docker.io)")
        self.stop()   # a crashed run's daemon, or its mounts
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        config = RUN_DIR / "daemon.json"
        config.write_text(json.dumps({"runtimes": {"runc-bounded": {"path": str(RUNC_BOUNDED)}},
                                      "default-runtime": "runc-bounded"}))
        argv = [DOCKERD, f"--config-file={config}", f"--data-root={STATE_DIR}", f"--exec-root={RUN_DIR / 'exec'}",
                f"--host=unix://{self.sock}", f"--pidfile={self.pidfile}", "--iptables=false", "--ip6tables=false",
                "--ip-forward=false", "--ip-masq=false", "--bridge=none",
                # its containerd (socket and state under the exec root) keeps its objects in namespaces of its own
                "--containerd-namespace=kxlb-kind", "--containerd-plugins-namespace=kxlb-kind-plugins"]
        env = {**self.env, MARKER_ENV: str(RUN_DIR)}
        with open(self.logfile, "a") as out:
            daemon = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                      start_new_session=True)
        deadline = time.monotonic() + 90
        while not self.answers():
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise KindError(f"dockerd did not start; its log {self.logfile}:\n{procs.tail(self.logfile)}")
            time.sleep(0.5)
        self.log(f"kind: dockerd up (socket {self.sock}, data root {STATE_DIR})")

    def stop(self) -> None:
        """Stop dockerd, which stops its containers and then its containerd; then whatever a
        crashed daemon left (containerd, shims, and the containers' processes under them);
        then unmount what is left under the run and data directories, and delete kind's
        bridge. The order matters: a shim that dies before its container leaves the
        container running, reparented to the host's init, with nothing to find it by."""
        dockerd = [p for p in self.pids() if procs.exe_name(p) == "dockerd"]
        _terminate(dockerd, grace=90)
        rest = self.pids()   # containerd and shims without their dockerd
        for pid in rest:
            for child in _children(pid):
                if child not in rest:   # a container's init: the whole container goes with it
                    _kill(child, signal.SIGKILL)
        _terminate(rest, grace=20)
        self.pidfile.unlink(missing_ok=True)
        for mnt in leftover_mounts():
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        if Path(f"/sys/class/net/{KIND_BRIDGE}").exists():
            subprocess.run(["ip", "link", "del", KIND_BRIDGE], capture_output=True)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _terminate(pids: list[int], grace: float) -> None:
    """SIGTERM, *grace* seconds, then SIGKILL what is left (and 10 s more)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        for pid in pids:
            _kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(procs.alive(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if procs.alive(p)]
        if not pids:
            return


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def leftover_mounts() -> list[str]:
    """Mount points under the kind lab's directories, deepest first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4]
            if any(mnt == str(d) or mnt.startswith(f"{d}/") for d in (RUN_DIR, STATE_DIR)):
                out.append(mnt)
    return sorted(out, key=len, reverse=True)


# ---- the node image -----------------------------------------------------------------------------
class NodeImage:
    """kind's node image, made here (see the module's doc); ``ensure()`` returns its tag."""

    def __init__(self, docker: Docker, bins: Bins, log: Callable[[str], None] = print):
        self.docker, self.bins, self.log = docker, bins, log
        self.out = cache_dir()

    @functools.cached_property
    def kind_files(self) -> Path:
        """kind's images/base/files, from the kind module build.sh fetched."""
        gomodcache = _run([self._go(), "env", "GOMODCACHE"], "go env GOMODCACHE").stdout.strip()
        d = Path(gomodcache) / "sigs.k8s.io" / f"kind@{self.bins.versions['KIND_VERSION']}" / "images" / "base" / "files"
        if not (d / "usr" / "local" / "bin" / "entrypoint").exists():
            _run([self._go(), "mod", "download", f"sigs.k8s.io/kind@{self.bins.versions['KIND_VERSION']}"],
                 "go mod download sigs.k8s.io/kind", env={**os.environ, "GOFLAGS": "-mod=mod"})
        return d

    @staticmethod
    def _go() -> str:
        return _run(["python3", str(REPO / "scripts" / "go_toolchain.py")],
                    "scripts/go_toolchain.py").stdout.strip()

    def image_archives(self) -> dict[str, Path]:
        """Every image the node holds, by reference: the control plane's for kubeadm (no
        kube-proxy: kind runs with kubeProxyMode none), and the lab's node images (pause,
        CoreDNS, agnhost and the e2e suite's others)."""
        out = self.out / "images"
        out.mkdir(parents=True, exist_ok=True)
        archives = dict(NodeImages.build(out, self.bins.node).archives)
        v = self.bins.k8s_version
        etcd = self.bins.versions["ETCD_VERSION"].lstrip("v")
        for name, ref in (("kube-apiserver", f"registry.k8s.io/kube-apiserver:{v}"),
                          ("kube-controller-manager", f"registry.k8s.io/kube-controller-manager:{v}"),
                          ("kube-scheduler", f"registry.k8s.io/kube-scheduler:{v}"),
                          ("etcd", f"registry.k8s.io/etcd:{etcd}-0")):
            layout, digest = images.binary_image(out, self.bins.control / name, ref)
            archive = out / f"{digest.split(':', 1)[1][:16]}.tar"
            if not archive.exists():
                images.write_archive(layout, archive)
            archives[ref] = archive
        return archives

    def key(self, archives: dict[str, Path]) -> str:
        files = self.kind_files
        parts = [json.dumps(NODE_PACKAGES).encode(), (NODE_DIR / "Dockerfile").read_bytes(),
                 (NODE_DIR / "default-storage.yaml").read_bytes(), self.bins.stamp(),
                 json.dumps({ref: images.archive_digest(a) for ref, a in sorted(archives.items())}).encode()]
        parts += [str(p.relative_to(files)).encode() + p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()]
        return content_digest(*parts)

    def ensure(self) -> str:
        archives = self.image_archives()
        tag = f"kxlb-kind-node:{self.bins.k8s_version}-{self.key(archives)}"
        if self.docker("image", "inspect", tag, check=False).returncode == 0:
            return tag
        t = time.monotonic()
        base = self._rootfs()
        staged = self._build(base, tag)
        self._import(staged, tag, archives)
        self.docker("rmi", staged, check=False)
        self.log(f"kind: node image {tag} built in {time.monotonic() - t:.0f}s")
        return tag

    def _rootfs(self) -> str:
        key = content_digest(json.dumps(NODE_PACKAGES).encode(), time.strftime("%Y-%m").encode())
        tag = f"kxlb-kind-rootfs:bookworm-{key}"
        if self.docker("image", "inspect", tag, check=False).returncode == 0:
            return tag
        tarball = self.out / "rootfs" / f"bookworm-{key}.tar"
        if not tarball.exists():
            t = time.monotonic()
            debian_rootfs(list(NODE_PACKAGES), tarball, self.out / "rootfs" / f"bookworm-{key}.log")
            self.log(f"kind: node root file system made by mmdebstrap in {time.monotonic() - t:.0f}s")
            for old in tarball.parent.glob("bookworm-*.tar"):
                if old != tarball:
                    old.unlink()
        self.docker("import", str(tarball), tag, what=f"docker import {tarball}")
        return tag

    def _build(self, base: str, tag: str) -> str:
        staged = f"{tag}-staged"
        with tempfile.TemporaryDirectory(prefix="kxlb-kind-node-") as d:
            ctx = Path(d)
            shutil.copy(NODE_DIR / "Dockerfile", ctx / "Dockerfile")
            shutil.copytree(self.kind_files, ctx / "files")
            (ctx / "bin").mkdir()
            (ctx / "local").mkdir()
            for name, src in (("kubelet", self.bins.node), ("kubeadm", self.bins.kind),
                              ("kubectl", self.bins.control)):
                shutil.copy(src / name, ctx / "bin" / name)
            for name in ("containerd", "containerd-shim-runc-v2", "ctr"):
                shutil.copy(self.bins.node / name, ctx / "local" / name)
            (ctx / "manifests").mkdir()
            shutil.copy(NODE_DIR / "default-storage.yaml", ctx / "manifests" / "default-storage.yaml")
            log = self.out / "node-image-build.log"
            r = self.docker("build", "--network=none", "--build-arg", f"BASE={base}", "--build-arg",
                            f"K8S_VERSION={self.bins.k8s_version}", "-t", staged, str(ctx), check=False,
                            timeout=900)
            log.write_text(r.stdout + r.stderr)
            if r.returncode:
                raise KindError(f"docker build of the kind node image failed; log {log}:\n{r.stderr.strip()[-2000:]}")
        return staged

    def _import(self, staged: str, tag: str, archives: dict[str, Path]) -> None:
        """Start the node's containerd in a container of *staged*, import every image
        (unpacked at first use, as kind's own build does), and commit."""
        name = f"kxlb-kind-imagebuild-{os.getpid()}"
        self.docker("run", "-d", "--privileged", "--network=none", "--name", name, "--entrypoint", "sleep",
                    staged, "infinity")
        try:
            self.docker("exec", "-d", name, "sh", "-c", "containerd >/var/log/containerd-build.log 2>&1")
            deadline = time.monotonic() + 60
            while self.docker("exec", name, "ctr", "version", check=False, timeout=30).returncode:
                if time.monotonic() > deadline:
                    raise KindError(f"containerd did not start in {name}: "
                                    f"{self.docker('exec', name, 'cat', '/var/log/containerd-build.log', check=False).stdout[-2000:]}")
                time.sleep(0.5)
            ctr = ["exec", "-i", name, "ctr", "--namespace=k8s.io", "images"]
            for ref, archive in sorted(archives.items()):
                with open(archive, "rb") as f:
                    self.docker(*ctr, "import", "--label=io.cri-containerd.pinned=pinned", "--all-platforms",
                                "--no-unpack", "--digests", "-", stdin=f, what=f"ctr import {ref}")
            self.docker(*ctr, "tag", "--force", images.PAUSE_IMAGE, KIND_PAUSE_IMAGE)
            self.docker(*ctr, "label", KIND_PAUSE_IMAGE, "io.cri-containerd.pinned=pinned")
            self.docker("exec", name, "pkill", "-x", "containerd")
            deadline = time.monotonic() + 30
            while self.docker("exec", name, "pgrep", "-x", "containerd", check=False).returncode == 0:
                if time.monotonic() > deadline:
                    raise KindError(f"containerd in {name} did not stop")
                time.sleep(0.2)
            self.docker("commit", "--change", 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
                        "--change", "CMD []", name, tag, what=f"docker commit {tag}")
        finally:
            self.docker("rm", "-f", name, check=False)


# ---- the cluster -------------------------------------------------------------------------------------
class KindCluster:
    """A kind cluster of deploy/kind-config.yaml (a control plane and two workers, no
    kube-proxy), kxlb's DaemonSet from deploy/kxlb.yaml, on the lab's dockerd."""

    proxy = "kxlb"

    def __init__(self, name: str = CLUSTER, log: Callable[[str], None] = print):
        self.name, self.log = name, log
        self.docker = Docker(log)
        self.kubeconfig = RUN_DIR / f"{name}.kubeconfig"
        self._bins: Optional[Bins] = None

    @property
    def bins(self) -> Bins:
        if self._bins is None:
            self._bins = Bins(self.log)
        return self._bins

    @property
    def bin_dir(self) -> Path:
        return self.bins.control

    def kind(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        return _run([str(self.bins.kind / "kind"), *args], f"kind {' '.join(args[:2])}", env=self.docker.env,
                    timeout=timeout, check=check)

    def kubectl(self, *args: str, input: Optional[str] = None, timeout: float = 120,
                check: bool = True) -> subprocess.CompletedProcess:
        return _run([str(self.bins.control / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                    f"kubectl {' '.join(args[:3])}", input=input, timeout=timeout, check=check)

    def node_names(self) -> list[str]:
        r = self.kind("get", "nodes", "--name", self.name, check=False, timeout=60)
        return sorted(n for n in r.stdout.split() if n) if r.returncode == 0 else []

    @property
    def nodes(self) -> int:
        """The nodes pods are scheduled on (the control plane is tainted): what the e2e
        suite's --num-nodes counts."""
        return len([n for n in self.node_names() if not n.endswith("-control-plane")])

    def exists(self) -> bool:
        r = self.kind("get", "clusters", check=False, timeout=60)
        return r.returncode == 0 and self.name in r.stdout.split()

    def config(self) -> Path:
        """deploy/kind-config.yaml, the user's file, with what a registry would have given:
        kind's default CNI off (kindnetd's image: ``cni()`` does its work), and kubeadm told
        the CoreDNS the lab builds (lab/k8s/coredns) instead of the release it would pull."""
        cfg = yaml.safe_load(KIND_CONFIG.read_text())
        cfg.setdefault("networking", {})["disableDefaultCNI"] = True
        coredns_tag = images.COREDNS_IMAGE.rsplit(":", 1)[1]
        cfg.setdefault("kubeadmConfigPatches", []).append(
            yaml.safe_dump({"kind": "ClusterConfiguration", "dns": {"imageTag": coredns_tag}}))
        path = RUN_DIR / f"{self.name}-config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    # -- up ----------------------------------------------------------------------------------------
    def up(self, *, kxlb: bool = True) -> dict:
        """Bring the cluster up (idempotent): timings of each step, in seconds."""
        times: dict[str, float] = {}
        t = time.monotonic()
        _run(["bash", str(REPO / "scripts" / "setup-kind.sh")], "scripts/setup-kind.sh", timeout=900)
        self.bins
        times["binaries"] = time.monotonic() - t
        t = time.monotonic()
        self.docker.start()
        image = NodeImage(self.docker, self.bins, self.log).ensure()
        times["node image"] = time.monotonic() - t
        t = time.monotonic()
        if self.exists() and not self.healthy():
            # a crash (its nodes exited) or a create that failed half-way: start again
            self.log(f"kind: cluster {self.name} exists but does not answer; deleting it to create it again")
            self.kind("delete", "cluster", "--name", self.name)
        if not self.exists():
            self.save_sysctls()
            self.ensure_network()
            self.log(f"kind: creating cluster {self.name} from {KIND_CONFIG.relative_to(REPO)} on {image}")
            self.kind("create", "cluster", "--name", self.name, "--image", image, "--config", str(self.config()),
                      "--kubeconfig", str(self.kubeconfig))
        times["create"] = time.monotonic() - t
        t = time.monotonic()
        self.cni()
        self.wait_nodes_ready()
        times["network"] = time.monotonic() - t
        if kxlb:
            t = time.monotonic()
            archive = ImageBuild(log=self.log).archive()[0]
            times["kxlb image"] = time.monotonic() - t
            t = time.monotonic()
            self.kind("load", "image-archive", str(archive), "--name", self.name)
            times["image load"] = time.monotonic() - t
            t = time.monotonic()
            self.kubectl("apply", "-f", str(MANIFEST))
            self.kubectl("-n", "kube-system", "rollout", "status", "daemonset/kxlb", "--timeout=600s", timeout=660)
            self.kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=300s", timeout=330)
            times["kxlb ready"] = time.monotonic() - t
        self.log("kind: up: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
        return times

    def healthy(self) -> bool:
        """Every node container runs and the API server answers."""
        for node in self.node_names():
            r = self.docker("inspect", "-f", "{{.State.Running}}", node, check=False, timeout=30)
            if r.stdout.strip() != "true":
                return False
        if not self.kubeconfig.exists():
            self.kubeconfig.write_text(self.kind("get", "kubeconfig", "--name", self.name).stdout)
        return self.kubectl("get", "--raw", "/readyz", check=False, timeout=30).returncode == 0

    def ensure_network(self) -> None:
        if self.docker("network", "inspect", KIND_NETWORK, check=False, timeout=30).returncode == 0:
            return
        self.docker("network", "create", "--driver=bridge", "-o", f"com.docker.network.bridge.name={KIND_BRIDGE}",
                    "-o", "com.docker.network.bridge.enable_ip_masquerade=false", KIND_NETWORK)

    # Host-wide sysctls the nodes' kubelets set (their containers are privileged, and these
    # are not per network namespace): kubelet's setupKernelTunables. Saved before the first
    # node starts, put back by down().
    HOST_SYSCTLS = ("kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory", "kernel/keys/root_maxkeys",
                    "kernel/keys/root_maxbytes")

    @property
    def sysctl_file(self) -> Path:
        return RUN_DIR / f"{self.name}-host-sysctls.json"

    def save_sysctls(self) -> None:
        if not self.sysctl_file.exists():
            self.sysctl_file.write_text(json.dumps(
                {k: Path("/proc/sys", k).read_text().strip() for k in self.HOST_SYSCTLS}))

    def restore_sysctls(self) -> None:
        if self.sysctl_file.exists():
            for k, v in json.loads(self.sysctl_file.read_text()).items():
                Path("/proc/sys", k).write_text(v)
            self.sysctl_file.unlink()

    def node_facts(self) -> dict[str, tuple[str, str]]:
        """{node: (InternalIP, pod CIDR)} from the API server."""
        out = {}
        for n in json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]:
            ip = next((a["address"] for a in n["status"].get("addresses", []) if a["type"] == "InternalIP"
                       and ":" not in a["address"]), None)
            out[n["metadata"]["name"]] = (ip, n["spec"].get("podCIDR"))
        return out

    def cni(self, timeout: float = 120) -> None:
        """What kindnetd does, once: each node's pod CIDR to the ptp plugin (a veth per pod,
        routed; addresses from host-local), and a route on each node to every other node's
        pod CIDR through that node. No masquerade: pods reach only the cluster's network."""
        deadline = time.monotonic() + timeout
        while True:
            facts = self.node_facts()
            if facts and all(ip and cidr for ip, cidr in facts.values()):
                break
            if time.monotonic() > deadline:
                raise KindError(f"nodes without an address or pod CIDR after {timeout:.0f}s: {facts}")
            time.sleep(1)
        for node, (ip, cidr) in facts.items():
            conf = {"cniVersion": "0.4.0", "name": "kxlb-kind", "plugins": [
                {"type": "ptp", "mtu": 1500, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}
            self.docker("exec", "-i", node, "sh", "-c", "cat > /etc/cni/net.d/10-kxlb-kind.conflist",
                        input=json.dumps(conf, indent=1), what=f"{node}: CNI config")
            for other, (oip, ocidr) in facts.items():
                if other != node:
                    self.docker("exec", node, "ip", "route", "replace", ocidr, "via", oip, what=f"{node}: route to {ocidr}")

    def wait_nodes_ready(self, timeout: float = 300) -> None:
        self.kubectl("wait", "--for=condition=Ready", "node", "--all", f"--timeout={timeout:.0f}s", timeout=timeout + 30)

    # -- down ----------------------------------------------------------------------------------------
    def down(self) -> None:
        """Delete the cluster and stop dockerd. Idempotent, also after a crash."""
        if self.docker.pids() and self.docker.answers():
            if self.exists():
                self.kind("delete", "cluster", "--name", self.name, check=False)
            self.docker("network", "rm", KIND_NETWORK, check=False)
        self.docker.stop()   # also what a crashed dockerd left, the bridge included
        self.restore_sysctls()
        for p in RUN_DIR.glob(f"{self.name}*"):
            p.unlink(missing_ok=True)

    def status(self) -> dict:
        up = bool(self.docker.pids()) and self.docker.answers()
        out = {"dockerd": up, "cluster": self.name, "exists": up and self.exists(), "kubeconfig": str(self.kubeconfig)}
        if out["exists"]:
            out["nodes"] = self.node_names()
            pods = self.kubectl("-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=kxlb", "-o", "json",
                                check=False)
            if pods.returncode == 0:
                out["kxlb"] = {p["spec"].get("nodeName"): p["status"].get("phase")
                               for p in json.loads(pods.stdout)["items"]}
        return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kxlb.lab.kind", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("up", "down", "status", "kubeconfig"),
                    help="up: the cluster with kxlb (idempotent); down: delete it and stop dockerd; "
                         "status: JSON; kubeconfig: its path, for KUBECONFIG")
    ap.add_argument("--no-kxlb", action="store_true", help="up without kxlb's DaemonSet (no service proxy at all)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("kind: run as root (dockerd, mmdebstrap, the nodes' networks)", file=sys.stderr)
        return 1
    cluster = KindCluster(log=lambda m: print(m, flush=True))
    try:
        if a.action == "up":
            cluster.up(kxlb=not a.no_kxlb)
            print(f"kind: cluster {cluster.name} is up: export KUBECONFIG={cluster.kubeconfig}")
        elif a.action == "down":
            cluster.down()
            print("kind: cluster deleted, dockerd stopped")
        elif a.action == "status":
            print(json.dumps(cluster.status(), indent=2))
        else:
            print(cluster.kubeconfig)
    except (LabError, ImageError) as exc:
        print(f"kind: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
