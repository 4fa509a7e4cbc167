"""Real-kubelet lab nodes: containerd 2.x, runc and the kubelet in a node's namespaces.

``kxlb lab up --kubelet`` runs, per node, what a kind node runs, without a container
image of the node itself:

- a **holder** process (the lab's pause binary) started with ``ip netns exec NODE unshare
  --mount --propagation slave``: it owns the node's mount namespace (a copy of the
  host's whose new mounts do not leak back) inside the node's network namespace, with
  the node's /sys. containerd and the kubelet are both started in *that* mount namespace
  (``nsenter -t HOLDER -m -n``), so the volumes the kubelet mounts are the ones
  containerd bind-mounts into containers; ``ip netns exec`` for each daemon would give
  each its own mount namespace;
- **containerd** (CRI, overlayfs, runc through containerd-shim-runc-v2, cgroupfs) with
  every directory under the node's own directory, its socket there, and the lab's CNI
  plugin (``lab/cni.py``): pods get the routed veths ``kxp*`` of the pod agent's layout;
- the **kubelet** with a ``system:node:<name>`` client certificate from the lab CA,
  webhook authentication and authorization (the API server's kubelet client is a
  ``system:masters`` certificate of the same CA), cgroup v1 through cgroupfs
  (``failCgroupV1: false``: this machine is hybrid), its cgroups under the node's
  cgroup path, so the node's pods are inside the node's cgroup v2 directory too.

Facts this follows: ``../shared/reference/real-kubelet-lab.md``.

What crosses between the node and the host goes through ``lab/relay.py``: the kubelet
reaches the API server at ``127.0.0.1:<api port>`` in the node's namespace, and the
API server reaches kubelets and pods through its egress selector: its "cluster"
traffic is HTTP CONNECT on a unix socket, which the relay dials from the first node's
namespace (``Lab.egress_selector``).

Images: no registry is reachable. pause and agnhost are built by ``lab/images.py`` and
imported into every node's containerd (``ctr images import``) under the names the e2e
framework uses; the kubelet never garbage-collects them (imageGC at 100%).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from . import images, kube, pki
from .errors import LabError
from .nodes import NodeSpec, kill_cgroup

KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS = "10.96.0.10"      # the kube-dns Service's clusterIP (a fixed address of the service CIDR)
RUNC = "/usr/sbin/runc"         # Debian's runc (built with libseccomp)
CNI_PLUGIN = "kxlb-cni"
ADDONS = Path(__file__).resolve().parent / "addons"


def v1_hierarchies() -> dict[str, Path]:
    """The mounted cgroup v1 hierarchies: name (``cpu``, ``name=systemd``, ...) -> mount point."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if fstype == "cgroup":
                names = [o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev",
                                                                   "noexec", "clone_children")]
                out[",".join(names)] = Path(mnt)
    return out


def make_v1_cgroup(rel: str) -> None:
    """``rel`` (e.g. ``/kxlab/kxlab-node-1``) in every v1 hierarchy; the kubelet refuses a
    cgroupRoot that does not exist. A new cpuset starts with no CPUs and no memory
    nodes, so those are copied down from the parent."""
    for name, mnt in v1_hierarchies().items():
        path = mnt
        for part in Path(rel).parts[1:]:
            parent, path = path, path / part
            if path.is_dir():
                continue
            path.mkdir()
            if "cpuset" in name.split(","):
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (path / f).write_text((parent / f).read_text())


def remove_v1_cgroups(rel: str) -> list[str]:
    """Kill what runs in ``rel`` of every v1 hierarchy and remove the directories."""
    removed = []
    for mnt in v1_hierarchies().values():
        path = mnt / rel.lstrip("/")
        if path.is_dir():
            kill_cgroup(str(path))
            removed.append(str(path))
    return removed


@dataclass(frozen=True)
class NodeImages:
    """The OCI archives every node imports, by reference."""
    archives: dict[str, Path]

    @classmethod
    def build(cls, out_dir: Path, node_bin: Path) -> "NodeImages":
        out_dir.mkdir(parents=True, exist_ok=True)
        archives = {}
        for ref, make in ((images.PAUSE_IMAGE, lambda: images.pause_image(out_dir)),
                          (images.AGNHOST_IMAGE, lambda: images.agnhost_image(out_dir, node_bin / "agnhost")),
                          (images.COREDNS_IMAGE, lambda: images.coredns_image(out_dir, node_bin / "coredns")),
                          (images.GLIBC_DNS_TESTING_IMAGE, lambda: images.dns_testing_image(out_dir)),
                          (images.BUSYBOX_IMAGE, lambda: images.busybox_image(out_dir)),
                          (images.REGRESSION_74839_IMAGE, lambda: images.regression_74839_image(
                              out_dir, node_bin / "regression-issue-74839"))):
            layout, digest = make()
            archive = out_dir / f"{digest.split(':', 1)[1][:16]}.tar"
            if not archive.exists():
                images.write_archive(layout, archive)
            archives[ref] = archive
        return cls(archives)


class KubeletNode:
    """One real-kubelet node: its files, its daemons' command lines, their health."""

    def __init__(self, workdir: Path, node: NodeSpec, *, node_bin: Path, cgroup2_root: str,
                 api_port: int, log: Optional[Callable[[str], None]] = None):
        self.node, self.node_bin, self.api_port = node, node_bin, api_port
        # The upstream port: the API server reaches it from inside the lab (its egress
        # proxy dials from a node's namespace), so two labs never share a listener.
        self.kubelet_port = KUBELET_PORT
        self.dir = Path(workdir) / "nodes" / node.name
        self.cgroup_parent = "/" + os.path.relpath(node.cgroup, cgroup2_root)
        self.log = log or (lambda m: None)

    # ---- paths --------------------------------------------------------------------------------
    @property
    def containerd_dir(self) -> Path:
        return self.dir / "containerd"

    @property
    def socket(self) -> Path:
        return self.containerd_dir / "containerd.sock"

    @property
    def kubelet_dir(self) -> Path:
        return self.dir / "kubelet"

    @property
    def cni_dir(self) -> Path:
        return self.dir / "cni"

    # ---- files --------------------------------------------------------------------------------
    def prepare(self, ca: pki.CertKey, python: str) -> None:
        """Write the node's configuration, certificate and CNI plugin; make its v1 cgroups."""
        for d in ("root", "state", "tmp", "opt", "runc"):
            (self.containerd_dir / d).mkdir(parents=True, exist_ok=True)
        for d in ("root", "pods-logs", "volume-plugins", "pki"):
            (self.kubelet_dir / d).mkdir(parents=True, exist_ok=True)
        for d in ("bin", "conf", "state"):
            (self.cni_dir / d).mkdir(parents=True, exist_ok=True)
        (self.containerd_dir / "config.toml").write_text(self.containerd_config())
        self._write_cni(python)
        self._write_kubelet(ca)
        make_v1_cgroup(self.cgroup_parent)

    def containerd_config(self) -> str:
        c = self.containerd_dir
        q = json.dumps  # TOML basic strings are JSON string literals
        return f"""# containerd of lab node {self.node.name} (written by lab/kubelet.py)
version = 3
root = {q(str(c / 'root'))}
state = {q(str(c / 'state'))}
temp = {q(str(c / 'tmp'))}
# Nothing here uses them; NRI would also open a socket under /var/run.
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.blockfile",
                    "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp",
                    "io.containerd.internal.v1.tracing"]

[grpc]
  address = {q(str(self.socket))}

[ttrpc]
  address = {q(str(c / 'containerd.sock.ttrpc'))}

[plugins.'io.containerd.internal.v1.opt']
  path = {q(str(c / 'opt'))}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # No registry: every image is imported; a pull would only time out.
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = {q(images.PAUSE_IMAGE)}

[plugins.'io.containerd.cri.v1.runtime']
  disable_apparmor = true
  # This machine's root lacks CAP_SYS_RESOURCE: a negative oom_score_adj (the sandbox's
  # -998, a Guaranteed pod's -997) is refused, so it is clamped to containerd's own.
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  disable_hugetlb_controller = true
  # Pod network namespaces under the node's state dir, not /var/run/netns of the host.
  netns_mounts_under_state_dir = true
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  cdi_spec_dirs = []
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {q(RUNC)}
        Root = {q(str(c / 'runc'))}
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{q(str(self.cni_dir / 'bin'))}]
    conf_dir = {q(str(self.cni_dir / 'conf'))}
    max_conf_num = 1
    use_internal_loopback = true

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _write_cni(self, python: str) -> None:
        plugin = self.cni_dir / "bin" / CNI_PLUGIN
        tmp = plugin.with_suffix(".tmp")
        tmp.write_text(f"#!/bin/sh\n# the lab's CNI plugin (lab/cni.py)\nexec {python} -m kxlb.lab.cni \"$@\"\n")
        tmp.chmod(0o755)
        os.replace(tmp, plugin)
        conf = {"cniVersion": "1.0.0", "name": "kxlab",
                "plugins": [{"type": CNI_PLUGIN, "stateDir": str(self.cni_dir / "state"),
                             "node": asdict(self.node)}]}
        (self.cni_dir / "conf" / "10-kxlab.conflist").write_text(json.dumps(conf, indent=2) + "\n")

    def _write_kubelet(self, ca: pki.CertKey) -> None:
        k = self.kubelet_dir
        name = self.node.name
        pki.write_public(k / "pki" / "ca.crt", ca.cert_pem)
        client = pki.issue(ca, f"system:node:{name}", orgs=["system:nodes"], client=True)
        pki.save(client, k / "pki", "kubelet-client")
        kubeconfig = pki.kubeconfig(f"https://127.0.0.1:{self.api_port}", ca.cert_pem, f"system:node:{name}",
                                    client.cert_pem, client.key_pem)
        pki.write_private(k / "kubeconfig", kubeconfig.encode())
        # No upstream DNS: a pod with dnsPolicy Default (and the host network) resolves nothing
        # outside the cluster, as the lab reaches nothing outside the machine.
        (k / "resolv.conf").write_text("# lab node: no upstream DNS server\noptions ndots:1\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_parent,
            "failSwapOn": False,
            "address": self.node.ip, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": KUBELET_HEALTHZ_PORT,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(k / "pki" / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "clusterDNS": [CLUSTER_DNS], "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(k / "resolv.conf"),
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(k / "pods-logs"),
            "volumePluginDir": str(k / "volume-plugins"),
            # The machine's disk is small and shared: never evict for disk, never drop an image.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                             "imagefs.available": "0%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "registerNode": True,
            "enableServer": True,
            "serverTLSBootstrap": False,
        }
        (k / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # ---- command lines ------------------------------------------------------------------------
    def holder_argv(self, pause: Path) -> list[str]:
        """The namespace holder: a new mount namespace (slave: the host's mounts show up,
        the node's stay inside), the node's network namespace, and a sysfs of that network
        namespace at /sys (as ``ip netns exec`` makes), with the host's cgroup and BPF
        filesystems moved over onto the new /sys: the kubelet and runc need the cgroup
        hierarchies, and kxlb's pinned maps live in bpffs (shared within the node)."""
        keep = self.dir / "sys-keep"
        script = (
            'set -e; k="$1"; shift\n'
            'for m in fs/cgroup fs/bpf; do\n'
            '  mountpoint -q "/sys/$m" || continue\n'
            '  mkdir -p "$k/$m"; mount --rbind "/sys/$m" "$k/$m"\n'
            'done\n'
            'umount -l /sys; mount -t sysfs sysfs /sys\n'
            'for m in fs/cgroup fs/bpf; do\n'
            '  mountpoint -q "$k/$m" || continue\n'
            '  mount --move "$k/$m" "/sys/$m"\n'
            'done\n'
            # Shared within the node (still a slave of the host's): the kxlb DaemonSet mounts
            # bpffs with Bidirectional propagation, which needs a shared source mount.
            'if mountpoint -q /sys/fs/bpf; then mount --make-rshared /sys/fs/bpf; fi\n'
            'exec "$@"\n')
        return ["unshare", "--mount", "--propagation", "slave", "--",
                "nsenter", f"--net=/var/run/netns/{self.node.netns}", "--",
                "sh", "-c", script, "holder", str(keep), str(pause)]

    @staticmethod
    def _enter(holder_pid: int) -> list[str]:
        return ["nsenter", "-t", str(holder_pid), "-m", "-n", "--"]

    def containerd_argv(self, holder_pid: int) -> list[str]:
        return self._enter(holder_pid) + [str(self.node_bin / "containerd"),
                                          "--config", str(self.containerd_dir / "config.toml")]

    def containerd_env(self) -> dict:
        # containerd finds containerd-shim-runc-v2 on PATH; TMPDIR keeps its temp files here.
        return {"PATH": f"{self.node_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "TMPDIR": str(self.containerd_dir / "tmp")}

    def kubelet_argv(self, holder_pid: int) -> list[str]:
        n, k = self.node, self.kubelet_dir
        return self._enter(holder_pid) + [
            str(self.node_bin / "kubelet"),
            f"--config={k / 'config.json'}", f"--kubeconfig={k / 'kubeconfig'}",
            f"--root-dir={k / 'root'}", f"--cert-dir={k / 'pki'}",
            f"--hostname-override={n.name}",
            f"--node-ip={','.join(a for a in (n.ip, n.ip6) if a)}",
            f"--node-labels=topology.kubernetes.io/zone={n.zone}",
            "--v=2",
        ]

    # ---- health -------------------------------------------------------------------------------
    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.node_bin / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io",
                               *args], capture_output=True, text=True, timeout=timeout)

    def containerd_ready(self) -> bool:
        return self.socket.exists() and self.ctr("version", timeout=5).returncode == 0

    def import_images(self, imgs: NodeImages) -> None:
        have = set(self.ctr("images", "list", "--quiet").stdout.split())
        for ref, archive in imgs.archives.items():
            if ref not in have:
                self.import_archive(ref, archive)

    def import_archive(self, ref: str, archive: Path) -> None:
        """Import an OCI archive into the node's containerd (its name points at the new
        content if it was there); nothing to do when *ref* already is that content."""
        want = images.archive_digest(archive)
        have = self.ctr("images", "list", f"name=={ref}").stdout.split()
        if want in have:
            return
        r = self.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        if r.returncode:
            raise LabError(f"{self.node.name}: ctr images import {archive} ({ref}): {r.stderr.strip()}")

    def node_object(self) -> dict:
        """The Node the lab creates before the kubelet registers: the podCIDRs of the
        lab's layout (the controller-manager does not allocate them), the zone label."""
        n = self.node
        return {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": n.name, "labels": {"kubernetes.io/hostname": n.name,
                                                        "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                                        "topology.kubernetes.io/zone": n.zone}},
                "spec": {"podCIDR": n.pod_cidr, "podCIDRs": [c for c in (n.pod_cidr, n.pod_cidr6) if c]}}

    def remove(self) -> list[str]:
        """The node's v1 cgroups and files (its processes must be stopped already)."""
        removed = remove_v1_cgroups(self.cgroup_parent)
        shutil.rmtree(self.dir, ignore_errors=True)
        return removed


def wait_for(what: str, check: Callable[[], bool], timeout: float, detail: Callable[[], str] = lambda: "") -> None:
    """``kube.wait_for`` as a LabError that ends with *detail* (a daemon's log tail)."""
    try:
        kube.wait_for(check, timeout, what)
    except TimeoutError as exc:
        extra = detail()
        raise LabError(f"{exc}{':' + chr(10) + extra if extra else ''}") from None
