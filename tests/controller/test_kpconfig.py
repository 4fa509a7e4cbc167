"""--config: kube-proxy's KubeProxyConfiguration (as kubeadm and kind write it)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kxlb.controller.kpconfig import go_duration, load
from kxlb.controller.main import register, resolve
from kxlb.loader.errors import KxlbError

# `kubeadm config print init-defaults --component-configs KubeProxyConfiguration` (v1.3x),
# with the values kind sets (mode, clusterCIDR, conntrack.maxPerCore) and a few more.
KUBEADM = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: node-a
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 1s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: 0.0.0.0:10249
mode: nftables
nftables:
  masqueradeAll: true
  masqueradeBit: null
  minSyncPeriod: 500ms
  syncPeriod: 1m0s
nodePortAddresses:
  - 192.168.0.0/16
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    register(sub)
    return p.parse_args(["controller", *argv])


def test_a_kubeadm_config_gives_every_setting_kxlb_implements(tmp_path):
    f = tmp_path / "config.conf"
    f.write_text(KUBEADM)
    a = args("--config", str(f))
    resolve(a)
    assert (a.node_name, a.kubeconfig, a.cluster_cidr, a.metrics_bind_address, a.healthz_bind_address) == \
        ("node-a", "/var/lib/kube-proxy/kubeconfig.conf", "10.244.0.0/16", "0.0.0.0:10249", "0.0.0.0:10256")
    assert (a.reconcile_period, a.min_sync_period, a.masquerade_all, a.nodeport_addresses) == \
        (60.0, 0.5, True, ["192.168.0.0/16"])


def test_with_a_config_file_its_flags_are_ignored_as_kube_proxys_but_the_node_name(tmp_path, caplog):
    """kube-proxy: with --config the file is the configuration (its flags are ignored,
    --hostname-override aside); kxlb says which flags it ignored. kxlb's own flags (not in
    the file format) apply."""
    f = tmp_path / "config.conf"
    f.write_text(KUBEADM)
    a = args("--config", str(f), "--node-name", "node-b", "--reconcile-period", "5", "--cluster-cidr", "10.0.0.0/8",
             "--healthz-bind-address", "127.0.0.1:20256", "--full-sync-period", "60")
    with caplog.at_level("WARNING"):
        resolve(a)
    assert (a.node_name, a.reconcile_period, a.cluster_cidr, a.healthz_bind_address, a.min_sync_period,
            a.full_sync_period) == ("node-b", 60.0, "10.244.0.0/16", "0.0.0.0:10256", 0.5, 60.0)
    said = sorted(r.getMessage().split(" is ignored")[0] for r in caplog.records if "is ignored with --config" in
                  r.getMessage())
    assert said == ["--cluster-cidr", "--healthz-bind-address", "--reconcile-period"]


@pytest.mark.parametrize("change, message", [
    (("detectLocalMode: \"\"", "detectLocalMode: InterfaceNamePrefix"), "detectLocalMode InterfaceNamePrefix"),
    (("syncPeriod: 1m0s", "syncPeriod: soon"), "nftables.syncPeriod: 'soon' is not a duration"),
    (("portRange: \"\"", "portRange: 30000-31000"), "portRange"),
    (("kind: KubeProxyConfiguration", "kind: KubeletConfiguration"), "not a KubeProxyConfiguration"),
])
def test_what_cannot_be_honoured_is_a_clear_error_naming_the_field(tmp_path, change, message):
    f = tmp_path / "config.conf"
    f.write_text(KUBEADM.replace(*change))
    with pytest.raises(KxlbError, match=message):
        load(str(f))


def test_the_sync_settings_come_from_the_section_of_the_mode(tmp_path):
    f = tmp_path / "config.conf"
    f.write_text(KUBEADM.replace("mode: nftables", "mode: ipvs").replace("  syncPeriod: 0s\n  tcpFinTimeout",
                                                                      "  syncPeriod: 45s\n  tcpFinTimeout"))
    s = load(str(f))
    assert (s.reconcile_period, s.min_sync_period, s.masquerade_all) == (45.0, None, None)


def test_durations_as_go_writes_them():
    assert [go_duration(t, "f") for t in ("30s", "1m0s", "500ms", "1h2m3s", "0s", "")] == [30, 60, 0.5, 3723, 0, 0]


def test_the_command_line_reports_a_bad_config_in_one_line(tmp_path):
    f = tmp_path / "config.conf"
    f.write_text(KUBEADM.replace("detectLocalMode: \"\"", "detectLocalMode: BridgeInterface"))
    r = subprocess.run([sys.executable, "-m", "kxlb", "controller", "--config", str(f)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("kxlb: error: --config: detectLocalMode")


def test_cidr_flags_take_one_cidr_per_family_and_name_the_flag_on_errors():
    from kxlb.controller.node import one_cidr_per_family, parse_nodeport_addresses

    assert one_cidr_per_family("10.244.0.0/16,fd00:10:244::/56", "--cluster-cidr") == \
        ("10.244.0.0/16", "fd00:10:244::/56")
    assert one_cidr_per_family("fd00::/48", "--cluster-cidr") == ("fd00::/48",)
    assert one_cidr_per_family(None, "--cluster-cidr") == ()
    with pytest.raises(KxlbError, match="--cluster-cidr: 'ten' is not a CIDR"):
        one_cidr_per_family("ten", "--cluster-cidr")
    with pytest.raises(KxlbError, match="more than one IPv6 CIDR"):
        one_cidr_per_family("fd00::/48,fd01::/48", "--cluster-cidr")
    assert parse_nodeport_addresses([]) == () and parse_nodeport_addresses(["primary"]) == ("primary",)
    assert parse_nodeport_addresses(["10.250.0.0/24,fd00::/64", "192.168.1.5/32"]) == \
        ("10.250.0.0/24", "fd00::/64", "192.168.1.5/32")
    # kube-proxy's keywords, mixed with CIDRs (today's kube-proxy takes them all)
    assert parse_nodeport_addresses(["primary,10.0.0.1/8", "localhost", "all", "primary"]) == \
        ("primary", "10.0.0.0/8", "localhost", "all")
    with pytest.raises(KxlbError, match="--nodeport-addresses: 'everything' is not a CIDR"):
        parse_nodeport_addresses(["primary,everything"])


@pytest.mark.parametrize("mode,extra,want", [
    ("", "", ["all", "127.0.0.0/8"]),
    ("iptables", "iptables:\n  localhostNodePorts: false\n", ["all"]),
    ("ipvs", "", ["all"]),
    ("nftables", "", []),
    ("iptables", "nodePortAddresses: [0.0.0.0/0]\n", ["0.0.0.0/0", "127.0.0.0/8"]),
    ("iptables", "nodePortAddresses: [fd00::/64]\n", ["fd00::/64", "127.0.0.0/8"]),   # IPv4: every address
    ("iptables", "nodePortAddresses: [192.168.0.0/16]\n", ["192.168.0.0/16"]),
    ("", "nodePortAddresses: [primary]\n", ["primary"]),
    ("nftables", "nodePortAddresses: [0.0.0.0/0]\n", ["0.0.0.0/0"])])
def test_unset_node_port_addresses_are_what_the_replaced_kube_proxy_served(tmp_path, mode, extra, want):
    """iptables mode with nodePortAddresses unset serves NodePorts on every local address
    and 127.0.0.0/8 (localhostNodePorts), and on 127.0.0.0/8 whenever its IPv4 CIDRs hold
    loopback; nftables mode defaults to primary, as kxlb, and serves loopback only when a
    CIDR aims at it."""
    f = tmp_path / "config.conf"
    f.write_text(f"apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                 f"hostnameOverride: n\nmode: \"{mode}\"\n{extra}")
    a = args("--config", str(f))
    resolve(a)
    assert a.nodeport_addresses == want


def test_kxlb_conntrack_is_sized_as_kube_proxy_sizes_nf_conntrack_max(tmp_path):
    """conntrack.maxPerCore x CPUs, at least conntrack.min (kube-proxy's defaults 32768 and
    131072); kind's maxPerCore 0 means min alone. kxlb sizes its own table with it."""
    from kxlb.controller.main import conntrack_flows
    from kxlb.loader.mapspec import conntrack_cflags

    f = tmp_path / "config.conf"
    f.write_text(KUBEADM)                     # kind's: maxPerCore 0, min null
    a = args("--config", str(f))
    resolve(a)
    assert conntrack_flows(a.conntrack_max_per_core, a.conntrack_min, cpus=64) == 131072
    f.write_text(KUBEADM.replace("maxPerCore: 0", "maxPerCore: 4096").replace("min: null", "min: 8192"))
    a = args("--config", str(f))
    resolve(a)
    assert conntrack_flows(a.conntrack_max_per_core, a.conntrack_min, cpus=4) == 16384
    a = args("--config", str(f), "--conntrack-min", "100000")   # ignored beside --config, as kube-proxy
    resolve(a)
    assert conntrack_flows(a.conntrack_max_per_core, a.conntrack_min, cpus=4) == 16384
    a = args("--conntrack-min", "100000", "--node-name", "n1")
    resolve(a)
    assert conntrack_flows(a.conntrack_max_per_core, a.conntrack_min, cpus=1) == 100000
    a = args("--node-name", "n1")
    resolve(a)
    assert conntrack_flows(a.conntrack_max_per_core, a.conntrack_min, cpus=8) == 262144
    assert conntrack_cflags(131072) == ["-DKXLB_CT_ENTRIES=131072", "-DKXLB_CT6_ENTRIES=32768"]
    with pytest.raises(KxlbError, match="conntrack.min: 'many' is not a count"):
        f.write_text(KUBEADM.replace("min: null", "min: many"))
        load(str(f))


def test_hostname_override_is_lowercased_and_unimplemented_fields_are_said(tmp_path, caplog):
    """kube-proxy's GetHostname trims and lower-cases the override (Node names are lower
    case); featureGates and bindAddress change kube-proxy's behaviour, so kxlb says it
    ignores them rather than dropping them silently."""
    f = tmp_path / "config.conf"
    f.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                 "hostnameOverride: ' Node-A.Example '\nbindAddress: 10.0.0.5\n"
                 "featureGates:\n  SomeGate: false\n")
    a = args("--config", str(f))
    with caplog.at_level("WARNING"):
        resolve(a)
    assert a.node_name == "node-a.example"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith("--config: featureGates {'SomeGate': False} is ignored") for m in said), said
    assert any(m.startswith("--config: bindAddress '10.0.0.5' is ignored") for m in said), said
