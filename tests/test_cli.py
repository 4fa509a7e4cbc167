"""The `kxlb` command line: bad input gives one clear line and changes nothing; a full
map is refused before anything is written; load/unload are idempotent and complete."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kxlb.loader import attach
from kxlb.loader.compile import compile_datapath
from kxlb.loader.mapspec import build_pins
from kxlb.loader.socklb import HOOKS

VIP = "10.96.0.10"


def kxlb(pin_dir, *args):
    return subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args],
                          capture_output=True, text=True)


def listing(pin_dir):
    r = kxlb(pin_dir, "list", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def small_dp(pin_dirs):
    """A datapath with tiny maps: 3 services (ids 1..3), 6 backend slots, 12 frontends,
    2 source ranges."""
    pin = pin_dirs()
    dp = compile_datapath(pin, ["-DKXLB_MAX_SERVICES=4", "-DKXLB_MAX_BACKEND_SLOTS=6", "-DKXLB_MAX_FRONTENDS=12",
                                "-DKXLB_SRC_RANGE_ENTRIES=2"])
    yield pin, dp


@pytest.fixture
def pin(small_dp):
    pin, _ = small_dp
    assert kxlb(pin, "service", "add", f"{VIP}:80/tcp", "10.1.0.1:8080", "10.1.0.2:8080").returncode == 0
    yield pin
    for svc in listing(pin):
        kxlb(pin, "service", "del", svc["service"])


@pytest.mark.parametrize("args, names", [
    (["service", "add", "10.96.0.300:80/tcp", "10.1.0.1:80"], "10.96.0.300"),
    (["service", "add", f"{VIP}:0/tcp", "10.1.0.1:80"], "port 0"),
    (["service", "add", f"{VIP}:65536/tcp", "10.1.0.1:80"], "port 65536"),
    (["service", "add", f"{VIP}:81/icmp", "10.1.0.1:80"], "'icmp'"),
    (["service", "add", f"{VIP}:81/tcp", "10.1.0.1:80", "10.1.0.1:80"], "duplicate backend 10.1.0.1:80"),
    (["service", "add", f"{VIP}:81/tcp", "10.1.0:80"], "10.1.0"),
    (["service", "add", f"{VIP}:81/tcp", "10.1.0.1:http"], "'http'"),
    (["service", "add", f"{VIP}:80/tcp", "10.1.0.3:80"], "already exists"),
    (["service", "set-backends", f"{VIP}:80/tcp", "10.1.0.1:8080", "10.1.0.1:8080"], "duplicate backend"),
    (["service", "set-backends", f"{VIP}:99/udp", "10.1.0.1:80"], "does not exist"),
    (["service", "del", f"{VIP}:99/udp"], "does not exist"),
    (["service", "add", "nonsense"], "VIP:PORT/tcp|udp"),
    (["service", "add", "fd00::10:80/tcp", "[fd00::1]:80"], "needs brackets"),
    (["service", "add", "[fd00::10]:80/tcp", "10.1.0.1:80"], "10.1.0.1:80 not IPv6 like the service"),
    (["service", "add", f"{VIP}:81/tcp", "[fd00::1]:80"], "[fd00::1]:80 not IPv4 like the service"),
    (["service", "add", "[fd00::zz]:80/tcp"], "'fd00::zz' is not an IP address"),
    (["service", "add", "[::ffff:10.1.0.1]:80/tcp"], "IPv4-mapped"),
    (["service", "add", "[fd00::10]:80/tcp", "--external-ip", "203.0.113.9"], "203.0.113.9:80/tcp (ExternalIP)"),
    (["service", "add", f"{VIP}:8_0/tcp", "10.1.0.1:80"], "port '8_0' is not a decimal number"),
    (["service", "add", "127.0.0.1:81/tcp", "10.1.0.1:80"], "'127.0.0.1' is loopback"),
    (["service", "add", f"{VIP}:81/tcp", "10.1.0.1:80", "--external-ip", "224.0.0.1"], "'224.0.0.1' is multicast"),
    (["service", "add", "[fd00::10]:81/tcp", "[fd00::1%eth0]:80"], "IPv6 zone index"),
])
def test_bad_input_is_one_clear_line_and_changes_nothing(pin, args, names):
    before = listing(pin)
    r = kxlb(pin, *args)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kxlb: error:") and names in lines[0], r.stderr
    assert listing(pin) == before


def test_full_service_map_is_refused_before_writing(pin):
    for port in (81, 82):
        assert kxlb(pin, "service", "add", f"{VIP}:{port}/tcp", "10.1.0.9:80").returncode == 0
    before = listing(pin)
    r = kxlb(pin, "service", "add", f"{VIP}:83/tcp", "10.1.0.9:80")
    assert r.returncode == 1 and "service map full" in r.stderr
    assert listing(pin) == before


def test_full_backend_map_is_refused_before_writing(pin):
    before = listing(pin)  # 2 of 6 slots used
    r = kxlb(pin, "service", "add", f"{VIP}:81/udp", *[f"10.1.1.{i}:80" for i in range(1, 6)])
    assert r.returncode == 1 and "backend map full" in r.stderr
    assert listing(pin) == before
    # A swap needs room for both generations at once. Slot 0 of the array is never used, so
    # 5 of the 6 hold backends: 2 old + 3 new fits, 3 + 3 does not.
    assert kxlb(pin, "service", "set-backends", f"{VIP}:80/tcp", *[f"10.1.1.{i}:80" for i in range(1, 4)]).returncode == 0
    r = kxlb(pin, "service", "set-backends", f"{VIP}:80/tcp", *[f"10.1.2.{i}:80" for i in range(1, 4)])
    assert r.returncode == 1 and "backend map full" in r.stderr
    assert [b for s in listing(pin) for b in s["backends"]] == [f"10.1.1.{i}:80" for i in range(1, 4)]


def test_list_conntrack_and_stats_json(pin):
    svc = listing(pin)
    assert svc == [{"service": f"{VIP}:80/tcp", "vip": VIP, "port": 80, "protocol": "tcp", "id": svc[0]["id"],
                    "frontends": [{"address": VIP, "port": 80, "kind": "ClusterIP"}],
                    "internal_traffic_policy": "Cluster", "external_traffic_policy": "Cluster",
                    "session_affinity_s": 0, "source_ranges": [], "has_endpoints": True,
                    "backends": ["10.1.0.1:8080", "10.1.0.2:8080"], "local_backends": []}]
    stats = json.loads(kxlb(pin, "stats", "--json").stdout)
    assert stats["services"][0]["service"] == f"{VIP}:80/tcp" and "new_flow" in stats["datapath"]
    assert json.loads(kxlb(pin, "conntrack", "--json").stdout) == []
    text = kxlb(pin, "list").stdout
    assert "-> 10.1.0.1:8080" in text and "TCP  10.96.0.10:80" in text


def test_service_add_with_every_frontend_kind_and_option(pin):
    r = kxlb(pin, "service", "add", f"{VIP}:443/tcp", "10.1.0.1:8443", "--local", "10.1.0.9:8443",
             "--node-port", "10.250.0.11:30443", "--external-ip", "203.0.113.7", "--load-balancer-ip", "198.51.100.5",
             "--external-local", "--affinity", "600", "--source-range", "192.0.2.0/24")
    assert r.returncode == 0, r.stderr
    svc = next(s for s in listing(pin) if s["port"] == 443)
    assert svc["frontends"] == [{"address": VIP, "port": 443, "kind": "ClusterIP"},
                                {"address": "10.250.0.11", "port": 30443, "kind": "NodePort"},
                                {"address": "203.0.113.7", "port": 443, "kind": "ExternalIP"},
                                {"address": "198.51.100.5", "port": 443, "kind": "LoadBalancer"}]
    assert (svc["external_traffic_policy"], svc["session_affinity_s"], svc["source_ranges"],
            svc["local_backends"]) == ("Local", 600, ["192.0.2.0/24"], ["10.1.0.9:8443"])
    text = kxlb(pin, "list").stdout
    assert "10.250.0.11:30443" in text and "NodePort" in text and "externalTrafficPolicy=Local" in text
    r = kxlb(pin, "service", "add", "10.96.0.11:443/tcp", "10.1.0.1:8443", "--external-ip", "203.0.113.7")
    assert r.returncode == 1 and "203.0.113.7:443/tcp (ExternalIP) is already served by" in r.stderr
    r = kxlb(pin, "service", "add", "10.96.0.12:443/tcp", "--source-range", "300.0.0.0/8")
    assert r.returncode == 1 and "source range '300.0.0.0/8'" in r.stderr
    before = listing(pin)
    r = kxlb(pin, "service", "add", "10.96.0.12:443/tcp", "--load-balancer-ip", "198.51.100.6",
             *[a for c in ("192.0.2.0/24", "198.18.0.0/15") for a in ("--source-range", c)])
    assert r.returncode == 1 and "source range map full: 1 of 2" in r.stderr, r.stderr
    assert listing(pin) == before


def test_ports_may_have_leading_zeros(pin):
    """Decimal digits only, with leading zeros allowed as Go's strconv.Atoi (kube-proxy)
    allows them: 0443 is 443, never octal."""
    r = kxlb(pin, "service", "add", f"{VIP}:0443/tcp", "10.1.0.1:08443", "--node-port", "10.250.0.11:030443")
    assert r.returncode == 0, r.stderr
    svc = next(s for s in listing(pin) if s["port"] == 443)
    assert (svc["backends"], svc["frontends"][1]) == (["10.1.0.1:8443"],
                                                      {"address": "10.250.0.11", "port": 30443, "kind": "NodePort"})


def test_help_lists_every_command():
    r = subprocess.run([sys.executable, "-m", "kxlb", "--help"], capture_output=True, text=True)
    for cmd in ("load", "unload", "service", "list", "conntrack", "stats", "demo"):
        assert cmd in r.stdout


# --- loader -------------------------------------------------------------------------------
def tc_filters(ns, iface):
    out = subprocess.run(["tc", "-n", ns, "filter", "show", "dev", iface, "ingress"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "kxlb_tc" in line]


def test_load_twice_duplicates_nothing_and_unload_removes_every_trace(netlab):
    pin = netlab.pin_dir
    args = ["load", "--netns", netlab.node, "--iface", netlab.client_iface]
    for _ in range(2):
        r = kxlb(pin, *args)
        assert r.returncode == 0, r.stderr
    assert len(tc_filters(netlab.node, netlab.client_iface)) == 1
    assert sorted(os.listdir(pin)) == sorted(build_pins())
    # Switching the same interface to XDP removes the tc program.
    assert kxlb(pin, "load", "--netns", netlab.node, "--iface", netlab.client_iface, "--xdp",
                "--xdp-trust-checksums").returncode == 0
    assert tc_filters(netlab.node, netlab.client_iface) == []
    assert attach.xdp_attached(netlab.node, netlab.client_iface) == "generic"
    assert kxlb(pin, "load", "--netns", netlab.node, "--iface", "be0").returncode == 0
    r = kxlb(pin, "unload")
    assert r.returncode == 0, r.stderr
    assert attach.xdp_attached(netlab.node, netlab.client_iface) is None
    assert tc_filters(netlab.node, "be0") == []
    qdiscs = subprocess.run(["tc", "-n", netlab.node, "qdisc", "show", "dev", "be0"], capture_output=True, text=True).stdout
    assert "clsact" not in qdiscs
    assert not os.path.exists(pin)
    assert kxlb(pin, "unload").returncode == 0  # idempotent


def test_maps_keep_their_content_across_reloads(netlab):
    pin = netlab.pin_dir
    base = ["load", "--netns", netlab.node, "--iface", netlab.client_iface]
    assert kxlb(pin, *base).returncode == 0
    assert kxlb(pin, "service", "add", f"{VIP}:80/tcp", "10.1.0.1:80").returncode == 0
    assert kxlb(pin, *base).returncode == 0
    assert [s["backends"] for s in listing(pin)] == [["10.1.0.1:80"]]
    kxlb(pin, "unload")


@pytest.mark.parametrize("args, message", [
    (["load", "--iface", "nosuch0", "--netns", "{node}"], "interface 'nosuch0' not found in network namespace"),
    (["load", "--iface", "eth0", "--netns", "kxl-no-such-ns"], "network namespace 'kxl-no-such-ns' not found"),
    (["--pin-dir", "/tmp/kxlb-not-bpffs", "load", "--iface", "lo"], "is not on a bpf filesystem"),
    (["list"], "no datapath pinned at"),
])
def test_loader_errors_are_one_clear_line(netlab, args, message):
    args = [a.replace("{node}", netlab.node) for a in args]
    r = kxlb(netlab.pin_dir, *args)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_compile_error_carries_the_compiler_message(tmp_path, monkeypatch, pin_dirs):
    from kxlb.loader import compile as comp
    from kxlb.loader.errors import KxlbError

    bad = tmp_path / "kxlb.c"
    bad.write_text('#include "maps.h"\nint kxlb_tc(struct __sk_buff *skb) { return undeclared_thing; }\n')
    (tmp_path / "maps.h").write_text("")
    monkeypatch.setattr(comp, "MAIN_SOURCE", bad)
    with pytest.raises(KxlbError) as err:
        comp.compile_datapath(pin_dirs())
    assert "undeclared_thing" in str(err.value)


def test_unload_detaches_socket_hooks_from_their_cgroup(netlab):
    """The controller's socket-level hooks outlive it in their cgroup: unload finds them
    through the registry and detaches them too."""
    from kxlb.loader.socklb import attach_socket_lb

    cgroup = f"/sys/fs/cgroup/unified/{netlab.tag}"
    os.makedirs(cgroup)
    try:
        compile_datapath(netlab.pin_dir)
        attach_socket_lb(netlab.pin_dir, cgroup)

        def ours():
            out = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup], capture_output=True, text=True).stdout
            return sorted(p["name"] for p in json.loads(out.strip() or "[]"))
        assert ours() == sorted(HOOKS)  # v4 and v4-mapped (dual-stack sockets)
        r = kxlb(netlab.pin_dir, "unload")
        assert r.returncode == 0, r.stderr
        assert ours() == [] and not os.path.exists(netlab.pin_dir)
    finally:
        os.rmdir(cgroup)


def test_ipv6_services_are_added_listed_and_counted_beside_ipv4(pin):
    """`kxlb service add [VIP6]:PORT/tcp [BACKEND6]:PORT ...`: IPv6 service ports in the
    IPv6 maps, every command speaking bracketed IPv6."""
    r = kxlb(pin, "service", "add", "[FD00:96::10]:80/tcp", "[fd00:1::11]:8080", "[fd00:1::12]:8080",
             "--node-port", "[fd00:250::11]:30080", "--load-balancer-ip", "2001:db8::5",
             "--source-range", "2001:db8:7::/48")
    assert r.returncode == 0, r.stderr
    assert "service [fd00:96::10]:80/tcp" in r.stdout
    svc6 = next(s for s in listing(pin) if ":" in s["vip"])
    assert (svc6["service"], svc6["vip"], svc6["backends"], svc6["source_ranges"]) == (
        "[fd00:96::10]:80/tcp", "fd00:96::10", ["[fd00:1::11]:8080", "[fd00:1::12]:8080"], ["2001:db8:7::/48"])
    assert {(f["address"], f["port"], f["kind"]) for f in svc6["frontends"]} == {
        ("fd00:96::10", 80, "ClusterIP"), ("fd00:250::11", 30080, "NodePort"), ("2001:db8::5", 80, "LoadBalancer")}
    assert kxlb(pin, "service", "set-backends", "[fd00:96::10]:80/tcp", "[fd00:1::13]:8080").returncode == 0
    assert next(s for s in listing(pin) if ":" in s["vip"])["backends"] == ["[fd00:1::13]:8080"]
    text = kxlb(pin, "list").stdout
    assert "[fd00:96::10]:80" in text and "-> [fd00:1::13]:8080" in text and "[fd00:250::11]:30080" in text
    stats = json.loads(kxlb(pin, "stats", "--json").stdout)
    assert {s["service"] for s in stats["services"]} == {f"{VIP}:80/tcp", "[fd00:96::10]:80/tcp"}
    assert kxlb(pin, "service", "del", "[fd00:96::10]:80/tcp").returncode == 0
    assert [s["service"] for s in listing(pin)] == [f"{VIP}:80/tcp"]
