"""The control plane's components: their command lines and their readiness probes.

``lab/controlplane.py`` decides when each starts and stops (through
``lab/supervisor.py``); this module says how each is run and how it is known to be
ready, from the control plane's configuration (the ``ControlPlane`` passed in).
"""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .controlplane import ControlPlane

ETCD = "etcd"
APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
SCHEDULER = "kube-scheduler"
COMPONENTS = (ETCD, APISERVER, CONTROLLER_MANAGER, SCHEDULER)


def argv(cp: "ControlPlane", comp: str) -> list[str]:
    """The command line of *comp*, with the control plane's extra arguments for it."""
    b = str(cp.bin_dir / comp)
    d = cp.pki_dir
    p = cp.ports
    v = f"--v={cp.verbosity}"
    if comp == ETCD:
        peer = f"http://127.0.0.1:{p.etcd_peer}"
        args = [
            b, "--name=kxlb-lab", f"--data-dir={cp.etcd_dir}",
            f"--listen-client-urls={cp.etcd_url}", f"--advertise-client-urls={cp.etcd_url}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kxlb-lab={peer}", "--initial-cluster-state=new",
            "--initial-cluster-token=kxlb-lab",
            # A throwaway store: durability buys nothing, fsync latency slows the apiserver.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]
    elif comp == APISERVER:
        args = [
            b,
            f"--advertise-address={cp.advertise_address}",
            f"--bind-address={cp.apiserver_bind_address}", f"--secure-port={p.apiserver}",
            f"--etcd-servers={cp.etcd_url}",
            f"--client-ca-file={d / 'ca.crt'}",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--kubelet-client-certificate={d / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={d / 'apiserver-kubelet-client.key'}",
            # As kubeadm sets it: dial a kubelet at its InternalIP, never by its
            # host name (the lab's node names resolve nowhere).
            "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--service-cluster-ip-range={cp.service_cidr}",
            f"--requestheader-client-ca-file={d / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={d / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={d / 'front-proxy-client.key'}",
            f"--cert-dir={d / 'apiserver-generated'}",
            "--profiling=false",
            v,
        ]
        if cp.node_port_range:
            args.append(f"--service-node-port-range={cp.node_port_range}")
    elif comp == CONTROLLER_MANAGER:
        args = [
            b, *_client_and_server(cp, "controller-manager", p.controller_manager),
            f"--root-ca-file={d / 'ca.crt'}",
            f"--service-account-private-key-file={d / 'sa.key'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={d / 'ca.crt'}",
            f"--cluster-signing-key-file={d / 'ca.key'}",
            f"--controllers={cp.controllers}",
            f"--service-cluster-ip-range={cp.service_cidr}",
            f"--cluster-name={cp.cluster_name}",
            # Default is /usr/libexec/kubernetes/..., which it would create on the host.
            f"--flex-volume-plugin-dir={cp.workdir / 'flexvolume'}",
            "--leader-elect=false", "--profiling=false", v,
        ]
    elif comp == SCHEDULER:
        args = [b, *_client_and_server(cp, "scheduler", p.scheduler), "--leader-elect=false", "--profiling=false", v]
    else:
        raise KeyError(comp)
    return args + list(cp.extra_args.get(comp, []))


def _client_and_server(cp: "ControlPlane", user: str, port: int) -> list[str]:
    """The controller-manager's and the scheduler's common flags: the API server as
    *user* (its kubeconfig, also for delegated authn/authz), and their own HTTPS
    endpoint on loopback with the serving certificate the lab's PKI issued them."""
    kc, d = cp.kubeconfig_dir / f"{user}.kubeconfig", cp.pki_dir
    return [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={d / f'{user}-serving.crt'}", f"--tls-private-key-file={d / f'{user}-serving.key'}",
            f"--client-ca-file={d / 'ca.crt'}"]


# ---- readiness ---------------------------------------------------------------------------------

def probe(cp: "ControlPlane", comp: str) -> tuple[bool, str]:
    """Is *comp* ready? (ready, what the check saw)."""
    if comp == ETCD:
        return _probe_etcd(cp.etcd_url)
    if comp == APISERVER:
        return _probe_https(cp, cp.ports.apiserver, "/readyz?verbose", cp.apiserver_host)
    port = {CONTROLLER_MANAGER: cp.ports.controller_manager, SCHEDULER: cp.ports.scheduler}[comp]
    return _probe_https(cp, port, "/healthz")


def probe_default_service_account(cp: "ControlPlane") -> tuple[bool, str]:
    """Has the serviceaccount controller created the default ServiceAccount (pods can
    be created only then)?"""
    return _probe_https(cp, cp.ports.apiserver, "/api/v1/namespaces/default/serviceaccounts/default",
                        cp.apiserver_host)


def _opener(ctx: Optional[ssl.SSLContext] = None) -> urllib.request.OpenerDirector:
    handlers: list = [urllib.request.ProxyHandler({})]  # never a proxy, whatever the env says
    if ctx is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ctx))
    return urllib.request.build_opener(*handlers)


def _get(url: str, ctx: Optional[ssl.SSLContext] = None) -> tuple[int, str]:
    try:
        with _opener(ctx).open(url, timeout=5) as r:
            return r.status, r.read(16384).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(16384).decode(errors="replace")


def _probe_etcd(url: str) -> tuple[bool, str]:
    try:
        code, body = _get(f"{url}/health")
    except (OSError, urllib.error.URLError) as e:
        return False, str(e)
    try:
        ok = code == 200 and json.loads(body).get("health") == "true"
    except ValueError:
        ok = False
    return ok, f"HTTP {code}: {body.strip()[:200]}"


def _probe_https(cp: "ControlPlane", port: int, path: str, host: str = "127.0.0.1") -> tuple[bool, str]:
    try:
        code, body = _get(f"https://{host}:{port}{path}", cp.ssl_context())
    except (OSError, urllib.error.URLError, ssl.SSLError) as e:
        return False, str(e)
    if code == 200:
        return True, "ok"
    # /readyz and /healthz list their checks; name only the failing ones.
    failed = [ln[3:].strip() for ln in body.splitlines() if ln.startswith("[-]")]
    return False, f"HTTP {code}: " + ("failing: " + "; ".join(failed) if failed else body.strip()[:300])
