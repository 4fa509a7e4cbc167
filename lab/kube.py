"""Kubernetes API helpers for the lab (tests, demo): raw JSON dicts, official client.

All functions take a ``kubernetes.client.ApiClient`` (``Lab.api_client()``) and return
plain dicts as the API server sent them (camelCase keys), so nothing depends on the
client's model classes.

    api = lab.api_client()
    ns = create_namespace(api, "demo")
    create_deployment(api, ns, "echo", replicas=3)          # kxlab/echo, ports below
    svc = create_service(api, ns, "echo", {"app": "echo"})  # ClusterIP, ports below
    pods = wait_pods_ready(api, ns, "app=echo", 3)
    eps = wait_endpoints(api, ns, "echo", {p["status"]["podIP"] for p in pods})
    set_pod_ready(api, ns, pods[0]["metadata"]["name"], False)   # the lab's readiness "probe"
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Iterable, Optional, TypeVar

from .podagent import ANN_READY, ANN_READY_TERMINATING

T = TypeVar("T")

# The echo workload's declared ports (the pod agent serves what is declared).
ECHO_PORTS = [
    {"name": "tcp", "containerPort": 8080, "protocol": "TCP"},
    {"name": "udp", "containerPort": 8080, "protocol": "UDP"},
    {"name": "http", "containerPort": 80, "protocol": "TCP"},
]
# A Service for ECHO_PORTS: port 80/tcp -> tcp echo, 80/udp -> udp echo, 8000/tcp -> http.
ECHO_SERVICE_PORTS = [
    {"name": "tcp", "port": 80, "targetPort": "tcp", "protocol": "TCP"},
    {"name": "udp", "port": 80, "targetPort": "udp", "protocol": "UDP"},
    {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
]
IMAGE = "kxlab/echo"
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


def _core(api):
    from kubernetes import client
    return client.CoreV1Api(api)


def _apps(api):
    from kubernetes import client
    return client.AppsV1Api(api)


def _discovery(api):
    from kubernetes import client
    return client.DiscoveryV1Api(api)


def _json(resp) -> dict:
    return json.loads(resp.data)


def wait_for(cond: Callable[[], Optional[T]], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll *cond* until it returns something truthy; TimeoutError naming *what* and the
    last value or exception otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            v = cond()
            if v:
                return v
            last = v
        except Exception as exc:  # noqa: BLE001 - report the last one
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g}s (last: {last!r})"[:2000])
        time.sleep(interval)


# ---- namespaces ---------------------------------------------------------------------------
def create_namespace(api, name: Optional[str] = None, labels: Optional[dict] = None) -> str:
    """Create a namespace (a random name with prefix ``kxlab-`` when *name* is None or ends
    with "-", which is then used as the prefix); wait for its default ServiceAccount."""
    if name is None or name.endswith("-"):
        name = f"{name or 'kxlab-'}{uuid.uuid4().hex[:6]}"
    name = name[:63].rstrip("-")
    _core(api).create_namespace({"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": name, "labels": labels or {}}}, _preload_content=False)
    wait_for(lambda: _core(api).read_namespaced_service_account("default", name, _preload_content=False),
             60, f"default ServiceAccount in {name}")
    return name


def delete_namespace(api, name: str, wait: bool = False, timeout: float = 120) -> None:
    try:
        _core(api).delete_namespace(name, _preload_content=False)
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) != 404:
            raise
    if wait:
        def gone():
            try:
                _core(api).read_namespace(name, _preload_content=False)
                return False
            except Exception as exc:  # noqa: BLE001
                if getattr(exc, "status", None) == 404:
                    return True
                raise
        wait_for(gone, timeout, f"namespace {name} deleted")


# ---- workloads -----------------------------------------------------------------------------
def pod_template(labels: dict, ports: Optional[list] = None, grace: int = 2, image: str = IMAGE,
                 node_name: Optional[str] = None, spread: bool = True, annotations: Optional[dict] = None,
                 host_network: bool = False) -> dict:
    spec: dict = {
        "containers": [{"name": "echo", "image": image, "ports": ECHO_PORTS if ports is None else ports}],
        "terminationGracePeriodSeconds": grace,
    }
    if node_name:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node_name}
    if spread:
        spec["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": labels}}]
    if host_network:
        spec["hostNetwork"] = True
    return {"metadata": {"labels": labels, "annotations": annotations or {}}, "spec": spec}


def create_deployment(api, ns: str, name: str, replicas: int = 3, *, labels: Optional[dict] = None,
                      ports: Optional[list] = None, grace: int = 2, node_name: Optional[str] = None,
                      spread: bool = True, annotations: Optional[dict] = None, image: str = IMAGE,
                      host_network: bool = False) -> dict:
    """A Deployment of echo pods (each answers with its pod name on *ports*, default
    ECHO_PORTS). *spread*: at most one pod of difference between nodes (hard constraint);
    *node_name*: all pods on one node; *grace*: terminationGracePeriodSeconds."""
    labels = labels or {"app": name}
    body = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": pod_template(labels, ports, grace, image, node_name, spread, annotations,
                                          host_network)},
    }
    return _json(_apps(api).create_namespaced_deployment(ns, body, _preload_content=False))


def scale_deployment(api, ns: str, name: str, replicas: int) -> None:
    _apps(api).patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": replicas}},
                                                 _content_type=MERGE, _preload_content=False)


def create_pod(api, ns: str, name: str, *, labels: Optional[dict] = None, ports: Optional[list] = None,
               node_name: Optional[str] = None, grace: int = 2, annotations: Optional[dict] = None,
               host_network: bool = False) -> dict:
    """A bare echo pod (scheduled by the scheduler, or bound to *node_name* directly)."""
    t = pod_template(labels or {"app": name}, ports, grace, node_name=None, spread=False, annotations=annotations,
                     host_network=host_network)
    if node_name:
        t["spec"]["nodeName"] = node_name
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {**t["metadata"], "name": name, "namespace": ns},
            "spec": t["spec"]}
    return _json(_core(api).create_namespaced_pod(ns, body, _preload_content=False))


def read_service(api, ns: str, name: str) -> dict:
    return _json(_core(api).read_namespaced_service(name, ns, _preload_content=False))


def patch_service(api, ns: str, name: str, patch: dict | list) -> dict:
    """A dict: a strategic merge patch (lists merge by key); a list: a JSON patch."""
    return _json(_core(api).patch_namespaced_service(name, ns, patch, _preload_content=False))


def create_service(api, ns: str, name: str, selector: Optional[dict] = None, ports: Optional[list] = None,
                   type: str = "ClusterIP", **spec) -> dict:
    """A Service (default: selector app=<name>, ECHO_SERVICE_PORTS, ClusterIP). Extra
    keyword arguments go into ``spec`` as they are (camelCase: sessionAffinity=...)."""
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"type": type, "selector": selector if selector is not None else {"app": name},
                     "ports": ECHO_SERVICE_PORTS if ports is None else ports, **spec}}
    return _json(_core(api).create_namespaced_service(ns, body, _preload_content=False))


# ---- reading and waiting -------------------------------------------------------------------------
def list_pods(api, ns: str, selector: str = "") -> list[dict]:
    return _json(_core(api).list_namespaced_pod(ns, label_selector=selector, _preload_content=False))["items"]


def is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def wait_pods_ready(api, ns: str, selector: str, count: int, timeout: float = 60) -> list[dict]:
    """Exactly *count* non-terminating pods matching *selector*, all Ready, with a podIP;
    returned sorted by name."""
    def ready():
        pods = [p for p in list_pods(api, ns, selector) if not p["metadata"].get("deletionTimestamp")]
        if len(pods) == count and all(is_ready(p) and p["status"].get("podIP") for p in pods):
            return sorted(pods, key=lambda p: p["metadata"]["name"])
        return None
    return wait_for(ready, timeout, f"{count} Ready pods {selector!r} in {ns}")


def endpoint_slices(api, ns: str, service: str) -> list[dict]:
    return _json(_discovery(api).list_namespaced_endpoint_slice(
        ns, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False))["items"]


def endpoints(api, ns: str, service: str) -> list[dict]:
    """Every endpoint of the service's EndpointSlices, flattened:
    {ip, node, pod, ready, serving, terminating, ports: {name: port}}."""
    out = []
    for s in endpoint_slices(api, ns, service):
        ports = {p.get("name") or "": p.get("port") for p in s.get("ports") or []}
        for e in s.get("endpoints") or []:
            c = e.get("conditions") or {}
            out.append({"ip": e["addresses"][0], "node": e.get("nodeName"),
                        "pod": (e.get("targetRef") or {}).get("name"),
                        "ready": c.get("ready", True) is not False, "serving": c.get("serving", True) is not False,
                        "terminating": bool(c.get("terminating", False)), "ports": ports})
    return sorted(out, key=lambda e: e["ip"])


def wait_endpoints(api, ns: str, service: str, ready_ips: Iterable[str], timeout: float = 60) -> list[dict]:
    """Until the service's ready endpoints are exactly *ready_ips* (any other endpoint is
    not ready); returns every endpoint."""
    want = set(ready_ips)

    def check():
        eps = endpoints(api, ns, service)
        return eps if {e["ip"] for e in eps if e["ready"]} == want else None
    return wait_for(check, timeout, f"EndpointSlices of {ns}/{service} with ready {sorted(want)}")


def set_pod_ready(api, ns: str, name: str, ready: bool, wait: bool = True, timeout: float = 30) -> dict:
    """Flip a pod's readiness through the pod agent (annotation ``kxlab.io/ready``);
    with *wait*, until the Ready condition shows it. Returns the pod."""
    _core(api).patch_namespaced_pod(name, ns, {"metadata": {"annotations": {ANN_READY: "true" if ready else "false"}}},
                                    _content_type=MERGE, _preload_content=False)
    if not wait:
        return _json(_core(api).read_namespaced_pod(name, ns, _preload_content=False))

    def done():
        p = _json(_core(api).read_namespaced_pod(name, ns, _preload_content=False))
        return p if is_ready(p) == ready else None
    return wait_for(done, timeout, f"pod {ns}/{name} Ready={ready}")


def set_ready_while_terminating(api, ns: str, name: str, ready: bool) -> None:
    """Whether the pod keeps Ready=True during its termination grace period (default yes)."""
    _core(api).patch_namespaced_pod(
        name, ns, {"metadata": {"annotations": {ANN_READY_TERMINATING: "true" if ready else "false"}}},
        _content_type=MERGE, _preload_content=False)


class Namespace:
    """The helpers above bound to one namespace (the ``k8s`` fixture of tests/lab)."""

    def __init__(self, api, name: str):
        self.api, self.name = api, name

    def deployment(self, name: str, replicas: int = 3, **kw) -> dict:
        return create_deployment(self.api, self.name, name, replicas, **kw)

    def scale(self, name: str, replicas: int) -> None:
        scale_deployment(self.api, self.name, name, replicas)

    def pod(self, name: str, **kw) -> dict:
        return create_pod(self.api, self.name, name, **kw)

    def service(self, name: str, selector: Optional[dict] = None, ports: Optional[list] = None,
                type: str = "ClusterIP", **spec) -> dict:
        return create_service(self.api, self.name, name, selector, ports, type, **spec)

    def pods(self, selector: str = "") -> list[dict]:
        return list_pods(self.api, self.name, selector)

    def ready_pods(self, app_or_selector: str, count: int, timeout: float = 60) -> list[dict]:
        """*count* Ready pods; ``"echo"`` means ``app=echo``."""
        sel = app_or_selector if "=" in app_or_selector else f"app={app_or_selector}"
        return wait_pods_ready(self.api, self.name, sel, count, timeout)

    def endpoints(self, service: str) -> list[dict]:
        return endpoints(self.api, self.name, service)

    def wait_endpoints(self, service: str, ready_ips: Iterable[str], timeout: float = 60) -> list[dict]:
        return wait_endpoints(self.api, self.name, service, ready_ips, timeout)

    def set_ready(self, pod: str, ready: bool, wait: bool = True) -> dict:
        return set_pod_ready(self.api, self.name, pod, ready, wait)

    def delete_pod(self, pod: str, grace: Optional[int] = None) -> None:
        from kubernetes import client
        client.CoreV1Api(self.api).delete_namespaced_pod(pod, self.name, grace_period_seconds=grace,
                                                         _preload_content=False)
