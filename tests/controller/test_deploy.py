"""deploy/: the DaemonSet and its RBAC against the real API server (kind itself cannot
run here): the manifests pass server-side validation, and the ServiceAccount may do
exactly what the controller does."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from kxlb.lab import controlplane as cpmod
from kxlb.lab import proxies, proxyimages

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def kubectl(cp, *args):
    return subprocess.run([str(cpmod.default_bin_dir() / "kubectl"), "--kubeconfig", str(cp.admin_kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


def test_daemonset_manifest_passes_server_side_validation(cp):
    r = kubectl(cp, "apply", "--dry-run=server", "-f", str(DEPLOY / "kxlb.yaml"))
    assert r.returncode == 0, r.stderr
    assert "daemonset.apps/kxlb created (server dry run)" in r.stdout


@pytest.fixture(scope="module")
def applied(cp):
    r = kubectl(cp, "apply", "-f", str(DEPLOY / "kxlb.yaml"))
    assert r.returncode == 0, r.stderr
    yield
    kubectl(cp, "delete", "-f", str(DEPLOY / "kxlb.yaml"), "--wait=false")


@pytest.mark.parametrize("verb, resource, allowed", [
    ("watch", "services", "yes"), ("list", "endpointslices.discovery.k8s.io", "yes"),
    ("watch", "nodes", "yes"), ("create", "events", "yes"), ("watch", "servicecidrs.networking.k8s.io", "yes"),
    ("create", "services", "no"), ("list", "secrets", "no"),
])
def test_rbac_grants_what_the_controller_uses_and_no_more(cp, applied, verb, resource, allowed):
    r = kubectl(cp, "auth", "can-i", verb, resource, "--as", "system:serviceaccount:kube-system:kxlb")
    assert r.stdout.strip() == allowed, (r.stdout, r.stderr)


# ---- the DaemonSets the real-kubelet lab applies (lab/proxies.py) -------------------------------
def dry_run(cp, docs: list[dict]) -> subprocess.CompletedProcess:
    return subprocess.run([str(cpmod.default_bin_dir() / "kubectl"), "--kubeconfig", str(cp.admin_kubeconfig),
                           "apply", "--dry-run=server", "-f", "-"],
                          input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", ["kxlb", "kxlb-xdp"])
def test_lab_kxlb_daemonset_is_deploy_yaml_with_the_lab_values(cp, mode):
    docs = proxies.kxlb_daemonset(mode, api_host="10.254.0.4", api_port=6443,
                                  cgroup_dir="/sys/fs/cgroup/unified/kx", bpffs="/sys/fs/bpf/kx")
    r = dry_run(cp, docs)
    assert r.returncode == 0, r.stderr
    assert "daemonset.apps/kxlb" in r.stdout and "(server dry run)" in r.stdout, r.stdout
    c = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["kxlb", "--pin-dir=/sys/fs/bpf/kx/$(NODE_NAME)", "controller"]
    assert "--iface=kxp*" in c["args"] and "--iface=veth*" not in c["args"]
    assert "--cgroup=/sys/fs/cgroup/unified/kx/$(NODE_NAME)" in c["args"]
    assert ("--xdp" in c["args"]) == (mode == "kxlb-xdp")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "10.254.0.4" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    # Everything else is deploy/kxlb.yaml's own: RBAC, probes, volumes.
    shipped = [d for d in yaml.safe_load_all((DEPLOY / "kxlb.yaml").read_text()) if d]
    assert [d["kind"] for d in docs] == [d["kind"] for d in shipped]
    assert docs[-1]["spec"]["template"]["spec"]["volumes"] == shipped[-1]["spec"]["template"]["spec"]["volumes"]


@pytest.mark.parametrize("mode, proxy_mode", [("kube-proxy", "nftables"), ("kube-proxy-iptables", "iptables"),
                                              ("kube-proxy-iptables-legacy", "iptables")])
def test_lab_kube_proxy_daemonset_is_kubeadms_with_the_mode(cp, mode, proxy_mode):
    docs = proxies.kube_proxy_daemonset(mode, image="registry.k8s.io/kube-proxy:v1.37.1", api_host="fd00::4",
                                        api_port=6443)
    r = dry_run(cp, docs)
    assert r.returncode == 0, r.stderr
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    conf = yaml.safe_load(cm["data"]["config.conf"])
    assert conf["mode"] == proxy_mode and conf["clusterCIDR"] == proxies.CLUSTER_CIDRS
    assert "server: https://[fd00::4]:6443" in cm["data"]["kubeconfig.conf"]
    c = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    path = next(e["value"] for e in c["env"] if e["name"] == "PATH")
    assert path.startswith(proxyimages.LEGACY_DIR) == (mode == "kube-proxy-iptables-legacy")
    assert "$(NODE_NAME)" in c["command"][-1]
