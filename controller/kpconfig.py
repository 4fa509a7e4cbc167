"""--config: a KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1), the
ConfigMap kubeadm and kind create for kube-proxy, so kxlb can replace kube-proxy on a
node without translating its settings by hand.

Every field kxlb implements is taken; as in kube-proxy, the file is then the
configuration and the flags of those settings are ignored (controller/main.py says which),
the node name aside. A field kxlb cannot honour with a non-default value is a clear error naming
it; fields that only tune what kube-proxy's backends need (iptables/ipvs details, Linux
conntrack sysctls kxlb's own conntrack does not use) are logged and ignored.
"""
from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass

from kxlb.loader.errors import KxlbError

log = logging.getLogger("kxlb.config")

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def go_duration(text, field: str) -> float:
    """A metav1.Duration ("30s", "1m0s", "500ms") in seconds."""
    if text in (None, "", 0, "0"):
        return 0.0
    if not isinstance(text, str) or not text or "".join(m.group(0) for m in _DURATION.finditer(text)) != text:
        raise KxlbError(f"--config: {field}: {text!r} is not a duration (like 30s, 1m0s, 500ms)")
    return sum(float(n) * _UNIT[u] for n, u in _DURATION.findall(text))


@dataclass
class FileSettings:
    """What the file sets (None: not set, the flag or kxlb's default applies)."""

    node_name: str | None = None
    kubeconfig: str | None = None
    metrics_bind_address: str | None = None
    healthz_bind_address: str | None = None
    cluster_cidr: str | None = None
    nodeport_addresses: list[str] | None = None
    min_sync_period: float | None = None
    reconcile_period: float | None = None
    full_sync_period: float | None = None   # not in KubeProxyConfiguration (kube-proxy: fixed 1 h)
    masquerade_all: bool | None = None
    detect_local: str | None = None     # ClusterCIDR or NodeCIDR
    conntrack_max_per_core: int | None = None  # conntrack.maxPerCore: sizes kxlb's own conntrack
    conntrack_min: int | None = None           # conntrack.min


def _bind(value, port: int) -> str | None:
    """kube-proxy takes "IP:PORT", or "IP" (its default port), or "" (not set)."""
    if not value:
        return None
    host, colon, p = str(value).rpartition(":")
    return str(value) if colon and p.isdigit() and not host.endswith(":") else f"{value}:{port}"


def load(path: str) -> FileSettings:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise KxlbError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise KxlbError(f"--config {path}: not YAML: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "KubeProxyConfiguration":
        raise KxlbError(f"--config {path}: not a KubeProxyConfiguration (kind: {doc.get('kind') if isinstance(doc, dict) else None!r})")
    if doc.get("apiVersion") != API_VERSION:
        raise KxlbError(f"--config {path}: apiVersion {doc.get('apiVersion')!r}, expected {API_VERSION}")
    return parse(doc)


def parse(doc: dict) -> FileSettings:
    s = FileSettings()
    s.node_name = doc.get("hostnameOverride") or None
    s.kubeconfig = (doc.get("clientConnection") or {}).get("kubeconfig") or None
    s.metrics_bind_address = _bind(doc.get("metricsBindAddress"), 10249)
    s.healthz_bind_address = _bind(doc.get("healthzBindAddress"), 10256)
    s.cluster_cidr = doc.get("clusterCIDR") or None
    mode = doc.get("mode") or ""
    if mode not in ("", "iptables", "nftables", "ipvs"):
        raise KxlbError(f"--config: mode {mode!r}: kxlb replaces kube-proxy's Linux backends only")
    if mode:
        log.info("--config: mode %s: kxlb's eBPF datapath serves instead", mode)
    s.nodeport_addresses = _nodeport_addresses(doc, mode)
    # kube-proxy's conversion: the sync settings of the backend the mode selects (iptables
    # when unset); masqueradeAll from nftables in nftables mode, else from iptables.
    section = {"nftables": "nftables", "ipvs": "ipvs"}.get(mode, "iptables")
    backend = doc.get(section) or {}
    # A zero duration ("0s", kubeadm's placeholder) means not set.
    s.reconcile_period = go_duration(backend.get("syncPeriod"), f"{section}.syncPeriod") or None
    s.min_sync_period = go_duration(backend.get("minSyncPeriod"), f"{section}.minSyncPeriod") or None
    masq = doc.get("nftables" if mode == "nftables" else "iptables") or {}
    if masq.get("masqueradeAll"):
        s.masquerade_all = True
    dl = doc.get("detectLocalMode") or ""
    if dl in ("InterfaceNamePrefix", "BridgeInterface"):
        raise KxlbError(f"--config: detectLocalMode {dl} is not supported by kxlb (ClusterCIDR and NodeCIDR are)")
    if dl not in ("", "ClusterCIDR", "NodeCIDR"):
        raise KxlbError(f"--config: detectLocalMode {dl!r} is not a kube-proxy mode")
    s.detect_local = dl or None
    if doc.get("portRange"):
        raise KxlbError("--config: portRange (the userspace proxy's) is not supported")
    ct = doc.get("conntrack") or {}
    for field in ("maxPerCore", "min"):  # kube-proxy's nf_conntrack_max: kxlb sizes its own table with them
        v = ct.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise KxlbError(f"--config: conntrack.{field}: {v!r} is not a count")
    s.conntrack_max_per_core = ct.get("maxPerCore")
    s.conntrack_min = ct.get("min")
    # Fields that change what kube-proxy does and kxlb does not implement: said, not
    # silently dropped (featureGates: kxlb follows each feature's default in v1.37).
    for field, why in (("featureGates", "kxlb implements each gate's v1.37 default"),
                       ("bindAddress", "the node IPs come from the Node object")):
        if doc.get(field) not in (None, "", {}, "0.0.0.0", "::"):
            log.warning("--config: %s %r is ignored (%s)", field, doc.get(field), why)
    tuned = [k for k, v in ct.items() if k not in ("maxPerCore", "min") and v not in (None, 0, "", "0s", False)]
    if tuned:
        log.warning("--config: conntrack.%s: Linux conntrack sysctls are left as they are (kxlb tracks its "
                    "flows in its own map)", ", conntrack.".join(sorted(tuned)))
    return s


def _nodeport_addresses(doc: dict, mode: str) -> list[str] | None:
    """nodePortAddresses as the kube-proxy being replaced served them. Unset, iptables and
    ipvs modes served NodePorts on every local address (nftables: primary, as kxlb); and
    iptables mode (localhostNodePorts, true by default) on 127.0.0.0/8 whenever its IPv4
    CIDRs hold loopback (ContainsIPv4Loopback), a family without CIDRs counting as all of
    it: made explicit here, since kxlb, as nftables mode, serves loopback only when asked."""
    items = doc.get("nodePortAddresses") or None
    if items is None and mode == "nftables":
        return None
    given = items is not None
    items = list(items) if given else ["all"]
    if mode in ("", "iptables") and (doc.get("iptables") or {}).get("localhostNodePorts") is not False:
        v4 = [str(c) for c in items if "." in str(c)] + (["0.0.0.0/0"] if "all" in items else [])
        if "primary" not in items and not v4:
            v4 = ["0.0.0.0/0"]
        try:
            loopback = any(ipaddress.ip_address("127.0.0.1") in ipaddress.ip_network(c, strict=False) for c in v4)
        except ValueError:
            loopback = False   # a bad CIDR: the flag's parser says so, naming it
        if loopback and "127.0.0.0/8" not in items:
            items.append("127.0.0.0/8")
    if not given or items != list(doc.get("nodePortAddresses") or ()):
        log.info("--config: mode %s: NodePorts on %s, as that kube-proxy served them", mode or "iptables (unset)",
                 ", ".join(items))
    return items


def merged(flag, file_value, default):
    """A flag given on the command line (one the file format has no field for, or the
    node name: controller/main.py drops the others beside --config), then the file, then
    the default."""
    if flag is not None:
        return flag
    return file_value if file_value is not None else default
