"""The service proxies a lab node runs: which program with which flags, how to tell it is
ready, and how to remove what it left in the node (nftables tables, KUBE-* iptables
chains of either backend, tc and XDP programs, pins, cgroup programs).

Pure per-node functions; `lab/proxyrun.py` (`Lab.set_proxy`) switches every node with them."""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .client import http_get
from .errors import LabError
from .nodes import CLUSTER_CIDR, CLUSTER_CIDR6, NodeSpec, netns_exists, run

# Dual-stack: one CIDR of each family, IPv4 first (the primary family, as kind's default).
CLUSTER_CIDRS = f"{CLUSTER_CIDR},{CLUSTER_CIDR6}"


@dataclass(frozen=True)
class ProxyMode:
    """A service proxy the lab can run on its nodes: which program, with which flags."""
    name: str
    kind: str                # "kxlb" (the controller), "kube-proxy", or "none"
    flags: tuple[str, ...] = ()
    help: str = ""
    # kube-proxy's iptables backend: "" is the iptables on PATH (Debian 12's is nf_tables);
    # "legacy" puts iptables-legacy first on its PATH under the plain names, as kind's
    # iptables-wrapper does on hosts whose rules are legacy.
    iptables: str = ""


PROXY_MODES = {m.name: m for m in (
    ProxyMode("kxlb", "kxlb", (), "kxlb controller, datapath at tc on the uplink and the pod interfaces"),
    # Generic XDP on veths: the frames the pods' stacks send carry CHECKSUM_PARTIAL,
    # which XDP cannot see; the lab's senders are all Linux stacks that finalise them.
    ProxyMode("kxlb-xdp", "kxlb", ("--xdp", "--xdp-trust-checksums"), "kxlb controller, datapath at XDP"),
    ProxyMode("kube-proxy", "kube-proxy", ("--proxy-mode=nftables",), "the real kube-proxy, nftables mode"),
    ProxyMode("kube-proxy-iptables", "kube-proxy", ("--proxy-mode=iptables",),
              "the real kube-proxy, iptables mode (the host's iptables: nf_tables backend)"),
    ProxyMode("kube-proxy-iptables-legacy", "kube-proxy", ("--proxy-mode=iptables",),
              "the real kube-proxy, iptables mode on the legacy (x_tables) backend", iptables="legacy"),
    ProxyMode("none", "none", (), "no service proxy"),
)}
PROXIES = tuple(PROXY_MODES)
# Per-node ports (loopback), shifted by port_offset and node index.
CONTROLLER_METRICS_BASE = 16500   # kxlb controller, host loopback
KUBE_PROXY_METRICS_BASE = 16600   # inside the node's namespace
KUBE_PROXY_HEALTHZ_BASE = 16700   # inside the node's namespace


def controller_options(node_port_range: Optional[str] = None, masquerade_ports: Optional[str] = None) -> list[str]:
    """The lab's options as `kxlb controller` flags: the API server's NodePort range (the
    controller keeps its masquerade ports outside it) and the masquerade ports."""
    return ([f"--service-node-port-range={node_port_range}"] if node_port_range else []) + \
        ([f"--masquerade-ports={masquerade_ports}"] if masquerade_ports else [])


def controller_argv(n: NodeSpec, mode: str, port_offset: int, kubeconfig: Path,
                    options: Sequence[str] = ()) -> list[str]:
    """`kxlb controller` on node *n*, as the DaemonSet runs it (host network, its pin dir);
    *options*: controller_options()."""
    port = CONTROLLER_METRICS_BASE + port_offset + n.index
    return [sys.executable, "-m", "kxlb", "--pin-dir", n.pin_dir, "controller",
            "--node-name", n.name, "--kubeconfig", str(kubeconfig),
            "--netns", n.netns, "--iface", "eth0", "--iface", "kxp*", "--cgroup", n.cgroup,
            "--cluster-cidr", CLUSTER_CIDRS, "--metrics-bind-address", f"127.0.0.1:{port}",
            *options, *PROXY_MODES[mode].flags]


def kube_proxy_argv(n: NodeSpec, mode: str, port_offset: int, kubeconfig: Path, bin_dir: Path) -> list[str]:
    """The real kube-proxy in node *n*'s network namespace."""
    mport = KUBE_PROXY_METRICS_BASE + port_offset + n.index
    hport = KUBE_PROXY_HEALTHZ_BASE + port_offset + n.index
    return ["ip", "netns", "exec", n.netns, str(bin_dir / "kube-proxy"),
            *PROXY_MODES[mode].flags, f"--hostname-override={n.name}",
            f"--kubeconfig={kubeconfig}", f"--cluster-cidr={CLUSTER_CIDRS}",
            f"--metrics-bind-address=127.0.0.1:{mport}", f"--healthz-bind-address=127.0.0.1:{hport}",
            # Host-wide conntrack sysctls are not ours to change (nor writable in a netns).
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", "--v=2"]


def health(mode: str, n: NodeSpec, port_offset: int) -> tuple[bool, str]:
    """Is *mode* ready on node *n* (kxlb: /readyz; kube-proxy: /healthz)? And why not."""
    if PROXY_MODES[mode].kind == "kxlb":  # the controller serves on the host's loopback
        return probe(CONTROLLER_METRICS_BASE + port_offset + n.index, "/readyz")
    return probe(KUBE_PROXY_HEALTHZ_BASE + port_offset + n.index, "/healthz", n.netns)


def probe(port: int, path: str, ns: Optional[str] = None) -> tuple[bool, str]:
    """GET 127.0.0.1:*port* *path* in namespace *ns*: (200?, what it said or why not)."""
    try:
        code, body = http_get("127.0.0.1", port, path, ns=ns)
    except OSError as exc:
        return False, str(exc)
    return code == 200, f"HTTP {code} {body.strip()[:200]}"


def log_name(mode: str, node: str) -> str:
    """The log file (under the lab's logs/) of *mode*'s process on *node*."""
    return f"kxlb-controller-{node}" if PROXY_MODES[mode].kind == "kxlb" else f"kube-proxy-{node}"


def clear_node(n: NodeSpec) -> None:
    """Remove what any proxy left in node *n* (its processes are stopped already)."""
    if netns_exists(n.netns):
        for fam in ("ip", "ip6", "inet"):
            run("ip", "netns", "exec", n.netns, "nft", "delete", "table", fam, "kube-proxy", check=False)
        clear_iptables(n)
    clear_bpf(n)


def iptables_env(workdir: Path, backend: str) -> Optional[dict]:
    """PATH for a kube-proxy whose iptables must be *backend* ("" = the host's)."""
    if not backend:
        return None
    shim = workdir / f"iptables-{backend}"
    shim.mkdir(parents=True, exist_ok=True)
    for tool in ("iptables", "ip6tables"):
        for suffix in ("", "-save", "-restore"):
            target = shutil.which(f"{tool}-{backend}{suffix}")
            if not target:
                raise LabError(f"{tool}-{backend}{suffix} is not installed (the iptables package has it)")
            link = shim / f"{tool}{suffix}"
            link.unlink(missing_ok=True)
            link.symlink_to(target)  # xtables-*-multi picks its mode from the name it is called by
    return {"PATH": f"{shim}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}

def clear_iptables(n: NodeSpec) -> None:
    """kube-proxy's iptables mode leaves KUBE-* chains (and jumps to them from the
    built-in chains) in the node's tables, of either backend: flush and delete those,
    nothing else."""
    for tool in ("iptables", "ip6tables", "iptables-legacy", "ip6tables-legacy"):
        for table in ("nat", "filter", "mangle"):
            dump = run("ip", "netns", "exec", n.netns, f"{tool}-save", "-t", table, check=False).stdout
            if "KUBE-" not in dump:
                continue
            kept = [line for line in dump.splitlines()
                    if "KUBE-" not in line or not (line.startswith(":") or line.startswith("-A"))]
            run("ip", "netns", "exec", n.netns, f"{tool}-restore", "-T", table, input="\n".join(kept) + "\n",
                check=False)

def clear_bpf(n: NodeSpec) -> None:
    """Remove kxlb from node *n* the way an operator goes back to kube-proxy: `kxlb cleanup`
    (loader/cleanup.py: what the registry in the pin directory records, then kxlb's tc
    filters, XDP programs and socket hooks found by name). Then check the node holds no
    BPF program on any interface and nothing in the pin directory: a cleanup that left
    something fails the lab's proxy switch, and so the tests that switch."""
    from kxlb.loader.cleanup import cleanup

    if not netns_exists(n.netns):
        shutil.rmtree(n.pin_dir, ignore_errors=True)
        return
    cleanup(n.pin_dir, n.netns, n.cgroup, wait=30)
    left = [f"{q['kind']} qdisc on {q['dev']}" for q in json.loads(
        run("tc", "-n", n.netns, "-j", "qdisc", "show", check=False).stdout or "[]") if q.get("kind") == "clsact"]
    left += [f"XDP on {x['ifname']}" for x in json.loads(
        run("ip", "-n", n.netns, "-j", "link", "show", check=False).stdout or "[]") if "xdp" in x]
    left += [f"pin directory {n.pin_dir}"] if os.path.exists(n.pin_dir) else []
    if left:
        raise LabError(f"kxlb cleanup left {', '.join(left)} on {n.name}")


# ---- as DaemonSets (real-kubelet labs) -----------------------------------------------------------
# On real-kubelet nodes the proxies run the way clusters run them: kxlb from its kustomize base
# (deploy/base), kube-proxy from kubeadm's manifest (lab/addons/kube-proxy.yaml), each with an
# image the lab builds (lab/proxyimages.py). What the lab changes in them is what differs on its
# nodes.
DEPLOY_BASE = Path(__file__).resolve().parent.parent / "deploy" / "base"
KUBE_PROXY_ADDON = Path(__file__).resolve().parent / "addons" / "kube-proxy.yaml"
DS_METRICS_PORT = 10249   # both proxies, on every address of the node
DS_HEALTHZ_PORT = 10256
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def daemonset_name(mode: str) -> str:
    return "kxlb" if PROXY_MODES[mode].kind == "kxlb" else "kube-proxy"


def kustomize(path: Path, kubectl: Optional[Path] = None) -> list[dict]:
    """``kubectl kustomize PATH``'s objects, as dicts: the manifests as a cluster's users
    render them (generated names and all), not a reading of our own."""
    import subprocess
    import yaml
    from .controlplane import default_bin_dir
    kubectl = kubectl or default_bin_dir() / "kubectl"
    r = subprocess.run([str(kubectl), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise LabError(f"kubectl kustomize {path}: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def kubeconfig_for_pods(server: str) -> dict:
    """A kubeconfig with the pod's ServiceAccount credentials for *server*, kubeadm's
    kubeconfig.conf of kube-proxy."""
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    return {"apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "default", "cluster": {"certificate-authority": f"{sa}/ca.crt", "server": server}}],
            "contexts": [{"name": "default", "context": {"cluster": "default", "namespace": "default",
                                                         "user": "default"}}],
            "current-context": "default",
            "users": [{"name": "default", "user": {"tokenFile": f"{sa}/token"}}]}


def kxlb_daemonset(mode: str, *, api_host: str, api_port: int, cgroup_dir: str, bpffs: str,
                   kubectl: Optional[Path] = None, options: Sequence[str] = ()) -> list[dict]:
    """deploy/base rendered by kustomize, with the lab's values where a cluster's overlay puts
    its own: in the ConfigMap, the API server's address, both families' cluster CIDRs,
    metrics on every address (as the lab's kube-proxy has them: tests scrape them from a
    pod), the uplink eth0 and the lab CNI's ``kxp*`` pod interfaces. In the DaemonSet, what
    no cluster-wide ConfigMap can say: each node has its own cgroup and pin directory under
    the host's (``$(NODE_NAME)``, expanded by the kubelet); and *mode*'s flags (XDP) and the
    lab's *options* (controller_options())."""
    import yaml
    docs = kustomize(DEPLOY_BASE, kubectl)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    conf = yaml.safe_load(cm["data"]["config.conf"])
    conf.update(clusterCIDR=CLUSTER_CIDRS, detectLocalMode="ClusterCIDR",
                metricsBindAddress=f"0.0.0.0:{DS_METRICS_PORT}")
    host = f"[{api_host}]" if ":" in api_host else api_host
    cm["data"].update({"config.conf": yaml.safe_dump(conf, sort_keys=False),
                       "kubeconfig.conf": yaml.safe_dump(kubeconfig_for_pods(f"https://{host}:{api_port}"),
                                                         sort_keys=False),
                       "uplink-interfaces": "eth0", "pod-interfaces": "kxp*"})
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    per_node = {"KXLB_CGROUP": f"{cgroup_dir}/$(NODE_NAME)",
                "KXLB_PIN_DIR": f"{bpffs}/$(NODE_NAME)"}   # read by `kxlb` itself (--pin-dir)
    c["env"] = [e for e in c["env"] if e["name"] not in per_node] + \
        [{"name": k, "value": v} for k, v in per_node.items()]   # after NODE_NAME, which they use
    c["args"] = c["args"] + list(options) + list(PROXY_MODES[mode].flags)
    return docs


def kube_proxy_daemonset(mode: str, *, image: str, api_host: str, api_port: int) -> list[dict]:
    """lab/addons/kube-proxy.yaml with the lab's values filled in."""
    import re
    import yaml
    m = PROXY_MODES[mode]
    proxy_mode = next(f.split("=", 1)[1] for f in m.flags if f.startswith("--proxy-mode="))
    from .proxyimages import LEGACY_DIR
    path = f"{LEGACY_DIR}:{IMAGE_PATH}" if m.iptables == "legacy" else IMAGE_PATH
    host = f"[{api_host}]" if ":" in api_host else api_host
    values = dict(CLUSTER_CIDR=CLUSTER_CIDRS, MODE=proxy_mode, API_SERVER=f"{host}:{api_port}", IMAGE=image,
                  PATH=path)
    # ${NAME} only: $(NODE_NAME) is the kubelet's to expand.
    text = re.sub(r"\$\{([A-Z_]+)\}", lambda mo: values[mo.group(1)], KUBE_PROXY_ADDON.read_text())
    return [d for d in yaml.safe_load_all(text) if d]


def daemonset_health(mode: str, n: NodeSpec) -> tuple[bool, str]:
    """``health`` for the DaemonSet's pod on node *n*: the same endpoints, on the node's
    own ports."""
    if PROXY_MODES[mode].kind == "kxlb":
        return probe(DS_METRICS_PORT, "/readyz", n.netns)
    return probe(DS_HEALTHZ_PORT, "/healthz", n.netns)
