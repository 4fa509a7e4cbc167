"""deploy/: kxlb's kustomize base, the kind overlay and deploy/kxlb.yaml rendered from them,
against the real API server (kind itself cannot run here): they pass server-side
validation, the ServiceAccount may do exactly what the controller does, the DaemonSet has
what lets it survive a loaded node (startup probe, probes on loopback, memory requested
and not limited), runs privileged only as docs/operations.md justifies, and the base holds
no value of one cluster. Then the DaemonSets the real-kubelet lab applies (lab/proxies.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from kxlb.controller import kpconfig
from kxlb.lab import controlplane as cpmod
from kxlb.lab import proxies, proxyimages

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE, KIND = DEPLOY / "base", DEPLOY / "overlays" / "kind"
OPERATIONS = REPO / "docs" / "operations.md"
KUBECTL = cpmod.default_bin_dir() / "kubectl"
# What a cluster must set: no default of these is right on every cluster.
REQUIRED_KEYS = {"kubeconfig.conf", "uplink-interfaces", "pod-interfaces"}
# The values the issue found hard-coded for kind, which only an overlay may hold.
KIND_VALUES = ("eth0", "veth", "10.244.", "kind-control-plane")


def kubectl(cp, *args, stdin: str | None = None):
    return subprocess.run([str(KUBECTL), "--kubeconfig", str(cp.admin_kubeconfig), *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def dry_run(cp, docs: list[dict]) -> subprocess.CompletedProcess:
    return kubectl(cp, "apply", "--dry-run=server", "-f", "-",
                   stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))


def one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def container(docs: list[dict]) -> dict:
    (c,) = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return c


def referenced_keys(docs: list[dict]) -> dict[str, bool]:
    """The ConfigMap keys the DaemonSet reads (env and the config volume) -> optional?"""
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    refs = {e["valueFrom"]["configMapKeyRef"]["key"]: bool(e["valueFrom"]["configMapKeyRef"].get("optional"))
            for e in container(docs)["env"] if "configMapKeyRef" in e.get("valueFrom", {})}
    for v in spec["volumes"]:
        if "configMap" in v:
            refs.update({i["key"]: bool(v["configMap"].get("optional")) for i in v["configMap"]["items"]})
    return refs


def file_settings(docs: list[dict]) -> kpconfig.FileSettings:
    """The ConfigMap's config.conf as the controller reads it (--config)."""
    return kpconfig.parse(yaml.safe_load(one(docs, "ConfigMap")["data"]["config.conf"]))


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return proxies.kustomize(BASE, KUBECTL)


@pytest.fixture(scope="module")
def kind() -> list[dict]:
    return proxies.kustomize(KIND, KUBECTL)


# ---- one source: deploy/kxlb.yaml is the kind overlay rendered --------------------------------------
def test_kxlb_yaml_is_the_kind_overlay_rendered_by_render_sh(tmp_path):
    out = tmp_path / "kxlb.yaml"
    r = subprocess.run(["sh", str(DEPLOY / "render.sh"), str(out)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUBECTL": str(KUBECTL)})
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (DEPLOY / "kxlb.yaml").read_text(), \
        "deploy/kxlb.yaml is stale: run KUBECTL=... deploy/render.sh"


@pytest.mark.parametrize("which", ["base", "kind"])
def test_manifests_pass_server_side_validation(cp, request, which):
    docs = request.getfixturevalue(which)
    r = dry_run(cp, docs)
    assert r.returncode == 0, r.stderr
    cm = one(docs, "ConfigMap")["metadata"]["name"]
    for made in ("serviceaccount/kxlb", "clusterrole.rbac.authorization.k8s.io/kxlb",
                 "clusterrolebinding.rbac.authorization.k8s.io/kxlb", f"configmap/{cm}", "daemonset.apps/kxlb"):
        assert f"{made} created (server dry run)" in r.stdout, r.stdout


# ---- RBAC --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def applied(cp):
    r = kubectl(cp, "apply", "-f", str(DEPLOY / "kxlb.yaml"))
    assert r.returncode == 0, r.stderr
    yield
    kubectl(cp, "delete", "-f", str(DEPLOY / "kxlb.yaml"), "--wait=false")


@pytest.mark.parametrize("verb, resource, allowed", [
    ("watch", "services", "yes"), ("list", "endpointslices.discovery.k8s.io", "yes"),
    ("watch", "nodes", "yes"), ("create", "events", "yes"), ("watch", "servicecidrs.networking.k8s.io", "yes"),
    ("create", "services", "no"), ("list", "secrets", "no"), ("get", "configmaps", "no"),
])
def test_rbac_grants_what_the_controller_uses_and_no_more(cp, applied, verb, resource, allowed):
    r = kubectl(cp, "auth", "can-i", verb, resource, "--as", "system:serviceaccount:kube-system:kxlb")
    assert r.stdout.strip() == allowed, (r.stdout, r.stderr)


# ---- a DaemonSet that survives a loaded node -----------------------------------------------------------
def test_probes_ask_loopback_where_the_config_binds_and_a_startup_probe_waits_five_minutes(kind):
    c = container(kind)
    probes = {name: c[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    for name, p in probes.items():
        assert p["httpGet"]["host"] == "127.0.0.1", name
        assert p.get("timeoutSeconds", 1) >= 5, name   # a busy node's Python server answers late
    where = {name: (p["httpGet"]["port"], p["httpGet"]["path"]) for name, p in probes.items()}
    assert where == {"startupProbe": (10249, "/readyz"), "readinessProbe": (10249, "/readyz"),
                     "livenessProbe": (10256, "/livez")}
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    # The ports the probes ask are where the controller listens: metrics on loopback only
    # (kube-proxy's default), kube-proxy's health server on every address (load balancers).
    s = file_settings(kind)
    assert (s.metrics_bind_address, s.healthz_bind_address) == ("127.0.0.1:10249", "0.0.0.0:10256")
    assert {p["containerPort"] for p in c["ports"]} == {10249, 10256}


def test_memory_is_requested_as_measured_and_not_limited(kind):
    res = container(kind)["resources"]
    assert "limits" not in res   # as kube-proxy: a limit below the cluster's size kills every node's proxy
    # The request is the one docs/operations.md derives from its measurements.
    assert set(res["requests"]) == {"cpu", "memory"}
    for what in ("cpu", "memory"):
        assert f"`{what}: {res['requests'][what]}`" in OPERATIONS.read_text(), \
            f"docs/operations.md does not state the {what} request {res['requests'][what]}"


# The capabilities docs/operations.md justifies: measured on the lab's DaemonSet (the
# interfaces' sysctls go over rtnetlink, loader/devconf.py).
CAPABILITIES = {"SYS_ADMIN", "NET_ADMIN"}


def test_not_privileged_and_no_bidirectional_mount(kind):
    c = container(kind)
    sc = c["securityContext"]
    assert not sc.get("privileged"), sc
    assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"]["add"]) == CAPABILITIES, sc
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # The controller mounts nothing: it uses the node's bpffs as the init container left it
    # (Bidirectional would need privileged for good).
    assert [m.get("mountPropagation") for m in c["volumeMounts"] if m.get("mountPropagation")] == ["HostToContainer"]
    text = OPERATIONS.read_text()
    for cap in CAPABILITIES:
        assert f"CAP_{cap}" in text, f"docs/operations.md does not give the reason for CAP_{cap}"


def test_only_the_bpffs_init_container_is_privileged(kind):
    """kind's nodes boot without bpffs: the init container mounts one on the node (through
    a Bidirectional volume, hence privileged) and runs nothing else; same image as kxlb."""
    spec = one(kind, "DaemonSet")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"] == ["kxlb", "mount-bpffs", "/sys/fs/bpf"] and "args" not in init
    assert init["image"] == container(kind)["image"]
    assert init["securityContext"] == {"privileged": True}
    assert init["volumeMounts"] == [{"name": "bpffs", "mountPath": "/sys/fs/bpf", "mountPropagation": "Bidirectional"}]
    assert "mount-bpffs" in OPERATIONS.read_text()


def test_runs_on_every_linux_node_before_anything_else(kind):
    spec = one(kind, "DaemonSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["hostNetwork"] and spec["dnsPolicy"] == "Default"   # not a cluster DNS it serves itself


# ---- the base holds no cluster's values; an overlay sets them ----------------------------------------------
def test_base_holds_no_value_of_one_cluster(base):
    text = yaml.safe_dump_all(base)
    assert not [v for v in KIND_VALUES if v in text]


def test_base_lacks_exactly_what_a_cluster_must_set_and_the_pod_says_which(base):
    refs = referenced_keys(base)
    assert not any(refs.values()), refs   # none optional: a missing key stops the pod, naming it
    assert set(refs) - set(one(base, "ConfigMap")["data"]) == REQUIRED_KEYS
    s = file_settings(base)
    # Which clients are pods, without a cluster's CIDR: the Node's podCIDRs.
    assert s.detect_local == "NodeCIDR" and s.cluster_cidr is None
    assert s.kubeconfig == "/var/lib/kxlb/kubeconfig.conf"


def test_kind_overlay_sets_every_key_with_kinds_values(kind):
    data = one(kind, "ConfigMap")["data"]
    assert set(referenced_keys(kind)) <= set(data)
    s = file_settings(kind)
    kind_config = yaml.safe_load((DEPLOY / "kind-config.yaml").read_text())
    assert s.cluster_cidr == kind_config["networking"]["podSubnet"] and s.detect_local == "ClusterCIDR"
    mount = next(m["mountPath"] for m in container(kind)["volumeMounts"] if m["name"] == "config")
    assert s.kubeconfig == f"{mount}/kubeconfig.conf"
    kubeconfig = yaml.safe_load(data["kubeconfig.conf"])
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://kind-control-plane:6443"
    assert kubeconfig["users"][0]["user"] == {"tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"}
    assert (data["uplink-interfaces"], data["pod-interfaces"]) == ("eth0", "veth*")


# ---- the DaemonSets the real-kubelet lab applies (lab/proxies.py) -------------------------------
@pytest.mark.parametrize("mode", ["kxlb", "kxlb-xdp"])
def test_lab_kxlb_daemonset_is_the_base_with_the_lab_values(cp, base, mode):
    options = proxies.controller_options("30000-30299", "20000-21023")   # the lab's options, as flags
    docs = proxies.kxlb_daemonset(mode, api_host="10.254.0.4", api_port=6443,
                                  cgroup_dir="/sys/fs/cgroup/unified/kx", bpffs="/sys/fs/bpf/kx", kubectl=KUBECTL,
                                  options=options)
    r = dry_run(cp, docs)
    assert r.returncode == 0, r.stderr
    assert "daemonset.apps/kxlb" in r.stdout and "(server dry run)" in r.stdout, r.stdout
    # The ConfigMap: what a cluster's overlay sets, with the lab's values.
    data = one(docs, "ConfigMap")["data"]
    assert set(referenced_keys(docs)) <= set(data)
    s = file_settings(docs)
    assert s.cluster_cidr == proxies.CLUSTER_CIDRS and s.detect_local == "ClusterCIDR"
    assert s.metrics_bind_address == f"0.0.0.0:{proxies.DS_METRICS_PORT}"   # scraped from pods, as kube-proxy's
    assert yaml.safe_load(data["kubeconfig.conf"])["clusters"][0]["cluster"]["server"] == "https://10.254.0.4:6443"
    assert (data["uplink-interfaces"], data["pod-interfaces"]) == ("eth0", "kxp*")
    # The DaemonSet: each node's own cgroup and pin directory, the mode's flags.
    c = container(docs)
    env = {e["name"]: e for e in c["env"]}
    assert env["KXLB_CGROUP"] == {"name": "KXLB_CGROUP", "value": "/sys/fs/cgroup/unified/kx/$(NODE_NAME)"}
    assert env["KXLB_PIN_DIR"] == {"name": "KXLB_PIN_DIR", "value": "/sys/fs/bpf/kx/$(NODE_NAME)"}
    assert [e["name"] for e in c["env"]].index("NODE_NAME") == 0   # defined before the values using it
    assert ("--xdp" in c["args"]) == (mode == "kxlb-xdp")
    assert c["args"][:len(container(base)["args"])] == container(base)["args"]
    assert c["args"][len(container(base)["args"]):] == options + list(proxies.PROXY_MODES[mode].flags)
    assert options == ["--service-node-port-range=30000-30299", "--masquerade-ports=20000-21023"]
    # Everything else is the base's own: RBAC, probes, security, volumes.
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [(d["kind"], d["metadata"]["name"]) for d in base]

    def without_env_and_args(d: dict) -> dict:
        d = json.loads(json.dumps(d))
        for k in ("env", "args"):
            del d["spec"]["template"]["spec"]["containers"][0][k]
        return d
    assert without_env_and_args(one(docs, "DaemonSet")) == without_env_and_args(one(base, "DaemonSet"))


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
