"""A real control plane (etcd + kube-apiserver + controller-manager + scheduler built from
Go modules), the standalone netns lab with real echo backends, and `kxlb controller`
running as its own process, programming the lab node's datapath from the API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kxlb.lab import controlplane as cpmod
from kxlb.lab.controlplane import ControlPlane, Ports
from kxlb.lab.netlab import NetLab
from kxlb.loader.maps import Maps
from kxlb.loader.services import ServiceTable

WORKDIR = Path("/tmp/kxlb-test-controller-cp")
PORTS = Ports().shifted(2000)
METRICS_PORT = 18249
NODE_IP = "10.201.0.1"  # the node namespace's address on the client side (lab/netlab.py)
BACKEND_PORT = 8080


@pytest.fixture(scope="session")
def cp():
    plane = ControlPlane(WORKDIR, cpmod.ensure_binaries(timeout=3600), ports=PORTS, iface="kxlb-apictl0",
                         advertise_address="10.254.0.4", controllers="*,-nodeipam,-nodelifecycle")
    plane.up()
    _register_node(plane)
    yield plane
    plane.down()  # logs stay in WORKDIR/logs; the next up() starts afresh


def _register_node(plane: ControlPlane) -> None:
    """The Node object of the controller's node, as a kubelet would register it: the
    controller reads its InternalIP (masquerade address, NodePorts) and kube-proxy's
    /healthz answers 503 while its Node does not exist."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(plane.admin_kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api:
        client.CoreV1Api(api).create_node({"metadata": {"name": "lab-node",
                                                        "labels": {"topology.kubernetes.io/zone": "zone-a"}},
                                           "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}})


@pytest.fixture(scope="session")
def api(cp):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cp.admin_kubeconfig), client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture
def ns(api):
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    yield name
    client.CoreV1Api(api).delete_namespace(name)


class ControllerProcess:
    """`kxlb controller` for the lab node, restartable, killable."""

    def __init__(self, cp: ControlPlane, lab: NetLab, extra: list[str] | None = None, test_periods: bool = True):
        self.cp, self.lab, self.extra = cp, lab, extra or []
        # Tests reconcile and fully resync every second (drift repair seen at once); a
        # benchmark runs the defaults a node runs (30 s, 1 h), or it measures the resyncs.
        self.periods = ["--reconcile-period", "1", "--full-sync-period", "1"] if test_periods else []
        self.proc: subprocess.Popen | None = None
        self.log = Path(f"/tmp/kxlb-test-controller-{lab.tag}.log")
        self.cgroup = f"/sys/fs/cgroup/unified/{lab.tag}"  # host-network processes of the node
        os.makedirs(self.cgroup, exist_ok=True)

    def start(self, wait_ready: bool = True) -> None:
        args = [sys.executable, "-m", "kxlb", "controller", "--node-name", "lab-node",
                "--kubeconfig", str(self.cp.admin_kubeconfig), "--pin-dir", self.lab.pin_dir,
                "--netns", self.lab.node, "--iface", "cli0", "--iface", "be*",
                "--metrics-bind-address", f"127.0.0.1:{METRICS_PORT}", *self.periods,
                "--cgroup", self.cgroup, *self.extra]
        self.proc = subprocess.Popen(args, stdout=open(self.log, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        # Ready comes after the datapath's compile: ~25 s on a quiet 2-core machine, more
        # than 30 beside CI's other job (the Vagrant VM's box build or boot under TCG).
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"controller exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if http_get("/readyz")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"controller not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait()

    def metric(self, name: str, **labels) -> float:
        total = 0.0
        for line in http_get("/metrics")[1].splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def http_get(path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture(scope="module")
def lab():
    with NetLab() as lab:
        lab.start_servers(BACKEND_PORT)
        yield lab
        subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", lab.pin_dir, "unload"], capture_output=True)


@pytest.fixture(scope="module")
def controller(cp, lab):
    c = ControllerProcess(cp, lab)
    c.start()
    yield c
    c.kill(signal.SIGTERM)
    os.rmdir(c.cgroup)  # detaches the socket hooks with it


def backend_ips(lab) -> list[str]:
    return [lab.backend_ip(i) for i in range(lab.backends_n)]


def make_service(api, ns: str, name: str, ports, endpoints, slice_ports=None, labels=None,
                 cluster_ip: str | None = None, **spec_extra) -> dict:
    """A selector-less Service and its EndpointSlice (as an external controller would
    publish it). ports: [(name, port, proto)]; endpoints: [(ip, conditions)];
    slice_ports: [(name, port, proto)] (default: same names, BACKEND_PORT); spec_extra:
    more spec fields (camelCase)."""
    from kubernetes import client

    spec = {"ports": [{"name": n, "port": p, "protocol": pr, "targetPort": BACKEND_PORT} for n, p, pr in ports]}
    if cluster_ip:
        spec["clusterIP"] = cluster_ip
    spec.update(spec_extra)
    svc = client.CoreV1Api(api).create_namespaced_service(
        ns, {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}, _preload_content=False)
    svc = json.loads(svc.data)
    put_slice(api, ns, name, endpoints, slice_ports or [(n, BACKEND_PORT, pr) for n, _, pr in ports], labels)
    return svc


def put_slice(api, ns, service, endpoints, ports, labels=None, slice_name=None):
    from kubernetes import client

    body = {"metadata": {"name": slice_name or f"{service}-1",
                         "labels": {"kubernetes.io/service-name": service,
                                    "endpointslice.kubernetes.io/managed-by": "kxlb-tests", **(labels or {})}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": cond} for ip, cond in endpoints],
            "ports": [{"name": n, "port": p, "protocol": pr} for n, p, pr in ports]}
    disc = client.DiscoveryV1Api(api)
    try:
        disc.replace_namespaced_endpoint_slice(body["metadata"]["name"], ns, body)
    except client.ApiException as e:
        if e.status != 404:
            raise
        disc.create_namespaced_endpoint_slice(ns, body)


READY = {"ready": True, "serving": True, "terminating": False}
DRAINING = {"ready": False, "serving": True, "terminating": True}   # terminating, still serving


def read_maps(lab) -> dict[str, list[str]]:
    """The lab's pinned maps now: service port -> its backends."""
    with Maps.open(lab.pin_dir) as maps:
        return {str(k): [str(b) for b in s.backends] for k, s in ServiceTable(maps).read_all().items()}


def wait_maps(lab, predicate, timeout: float = 10.0, what: str = "maps"):
    """Poll the lab's pinned maps until predicate(services dict) holds; return it."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = read_maps(lab)
        if predicate(last):
            return last
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout}s; maps hold {last}")
