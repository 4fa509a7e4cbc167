"""Loads that never break the running datapath: a refused or failed load changes
nothing, a changed map is migrated with its contents, and an upgrade from the previous
release (and a roll back to it) keeps every open connection. Real namespaces, real
sockets, the previous release's own code (tests/oldrelease.py)."""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys

import pytest

import oldrelease
from kxlb.lab.client import backends_answering
from harness import Holder, add_tc_filter
from kxlb.loader import bpfsys, datapath
from kxlb.loader import compile as comp
from kxlb.loader.errors import KxlbError
from kxlb.loader.layout import V4
from kxlb.loader.maps import BpfMap, Maps
from kxlb.loader.mapspec import current_pin
from kxlb.loader.services import DatapathConfig, ServiceTable

VIP = "10.96.5.1"
GONE_VIP = "10.96.7.7"  # a service deleted with a connection open


def kxlb(pin_dir, *args):
    return subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args],
                          capture_output=True, text=True, timeout=300)


def pins(pin_dir) -> dict[str, int]:
    """Pin name -> inode: the same inode is the same map or program."""
    return {n: os.lstat(os.path.join(pin_dir, n)).st_ino for n in os.listdir(pin_dir)}


def tc_prog(ns, iface, direction="ingress") -> str:
    """The id of our tc program on ``iface`` ("" when none)."""
    out = subprocess.run(["tc", "-n", ns, "filter", "show", "dev", iface, direction], capture_output=True,
                         text=True).stdout
    return " ".join(m.group(1) for line in out.splitlines() if "kxlb" in line
                    for m in [re.search(r"\bid (\d+)", line)] if m)


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """release -> its tree, unpacked when first asked for."""
    built: dict[str, object] = {}

    def get(release):
        if release not in built:
            built[release] = oldrelease.build(tmp_path_factory.mktemp("release"), release)
        return built[release]
    return get


@pytest.fixture
def old(releases):
    """kxlb 0.1, which kept its records in /run."""
    return releases("0.1.0")


def old_kxlb(path, pin_dir, *args):
    return subprocess.run(oldrelease.command(path, "--pin-dir", pin_dir, *args), capture_output=True, text=True,
                          timeout=300)


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("release", sorted(oldrelease.RELEASES))
def test_upgrade_from_the_previous_release_and_back_keeps_every_connection(netlab, releases, release):
    """An earlier release serves a VIP (TCP, UDP) and a masqueraded NodePort with
    connections open; this release loads over it (from 0.1.0, conntrack converted from two
    entries a flow to a record per client socket, masqueraded flows' ports into the port
    table; from both, backend slots from a hash map into runs of an array), `kxlb
    downgrade` and that release load back over this one, this one again: every connection
    keeps its backend throughout, new connections reach every backend, and no datagram
    of a 200/s stream is lost. One service is deleted before the upgrade with a connection
    open: that flow's frontend and backend are then named only by conntrack, and the new
    address filters (0.2.0 has them too) must learn them from it."""
    old = releases(release)
    lab, pin = netlab, netlab.pin_dir
    lab.start_servers(8080, 8081)
    ifaces = [a for i in lab.node_ifaces for a in ("--iface", i)]
    ok(old_kxlb(old, pin, "load", "--netns", lab.node, *ifaces))
    backends = [f"{lab.backend_ip(i)}:8080" for i in range(3)]
    ok(old_kxlb(old, pin, "service", "add", f"{VIP}:80/tcp", *backends, "--node-port", f"{lab.node_client_ip}:30080"))
    ok(old_kxlb(old, pin, "service", "add", f"{VIP}:53/udp", *backends))
    # Masquerade the NodePort's outside clients to the node's address: written into that
    # release's config map (a layout every release shares) as its controller would.
    config = BpfMap(os.path.join(pin, "config"), ctypes.c_uint32, V4.LbConfig)
    config.put(ctypes.c_uint32(0), DatapathConfig(snat_addrs=(lab.node_client_ip,)).to_c(V4))
    config.close()
    ok(old_kxlb(old, pin, "service", "add", f"{GONE_VIP}:81/tcp", f"{lab.backend_ip(1)}:8081"))
    targets = ([("tcp", VIP, 80)] * 4 + [("tcp", lab.node_client_ip, 30080)] * 3 + [("udp", VIP, 53)] * 3
               + [("tcp", GONE_VIP, 81)])
    holder = Holder(lab.client, targets)
    try:
        first = holder.first
        assert all(b.startswith("be") for b in first), first
        ok(old_kxlb(old, pin, "service", "del", f"{GONE_VIP}:81/tcp"))  # its flow lives on
        flows = len(json.loads(ok(old_kxlb(old, pin, "conntrack", "--json")).stdout))  # as that release lists them
        holder.ask("ping", "start", VIP, 53)
        before = tc_prog(lab.node, "cli0")
        r = ok(kxlb(pin, "load", "--netns", lab.node, *ifaces))              # upgrade
        assert "4 earlier attachments now run this build" in r.stdout, r.stdout
        if release == "0.1.0":
            assert "migrated conntrack: layout 1 -> 2" in r.stdout, r.stdout   # two entries a flow -> a record
        assert "migrated services: layout 1 -> 2" in r.stdout, r.stdout    # slots: a hash -> runs of an array
        assert tc_prog(lab.node, "cli0") != before
        assert holder.ask("probe") == first
        names = {f"be{i}" for i in range(3)}
        assert backends_answering(lab.client, VIP, 80, names) == names     # new flows, from the converted slots
        r = ok(kxlb(pin, "downgrade", "--to", release))                    # roll back: its layouts again,
        if release == "0.1.0":                                              # then the old release loads
            assert "wrote conntrack: layout 2 -> 1" in r.stdout, r.stdout
        assert "wrote services: layout 2 -> 1" in r.stdout, r.stdout
        ok(old_kxlb(old, pin, "load", "--netns", lab.node, *ifaces))
        assert holder.ask("probe") == first
        assert backends_answering(lab.client, VIP, 80, names) == names
        r = ok(kxlb(pin, "load", "--netns", lab.node, *ifaces))              # and up again
        assert holder.ask("probe") == first
        stream = holder.ask("ping", "stop")
        print(f"datagrams through the three swaps: {stream}")
        assert stream["sent"] > 100 and stream["received"] == stream["sent"], stream
        assert len(json.loads(ok(kxlb(pin, "conntrack", "--json")).stdout)) >= flows
    finally:
        holder.close()
    r = ok(kxlb(pin, "unload"))
    assert not os.path.exists(pin)
    assert tc_prog(lab.node, "cli0") == ""
    assert not os.path.exists(f"/run/kxlb/{pin.strip('/').replace('_', '%5F').replace('/', '_')}.json")


def test_a_pin_of_another_layout_is_refused_and_changes_nothing(netlab):
    pin = netlab.pin_dir
    ok(kxlb(pin, "load", "--netns", netlab.node, "--iface", "cli0"))
    ok(kxlb(pin, "service", "add", f"{VIP}:80/tcp", f"{netlab.backend_ip(0)}:80"))
    os.unlink(os.path.join(pin, "affinity"))  # another tool's map under one of our names
    subprocess.run(["bpftool", "map", "create", f"{pin}/affinity", "type", "lru_hash", "key", "12", "value", "8",
                    "entries", "16", "name", "other"], check=True)
    before, prog = pins(pin), tc_prog(netlab.node, "cli0")
    r = kxlb(pin, "load", "--netns", netlab.node, "--iface", "cli0")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "affinity" in r.stderr and "value size 8 (this kxlb: 16)" in r.stderr, r.stderr
    assert pins(pin) == before and tc_prog(netlab.node, "cli0") == prog


def test_a_newer_layout_is_refused(netlab):
    pin = netlab.pin_dir
    ok(kxlb(pin, "load", "--netns", netlab.node, "--iface", "cli0"))
    subprocess.run(["bpftool", "map", "create", f"{pin}/conntrack_v9", "type", "lru_hash", "key", "16", "value", "48",
                    "entries", "16", "name", "ct_map"], check=True)
    before = pins(pin)
    r = kxlb(pin, "load", "--netns", netlab.node, "--iface", "cli0")
    assert r.returncode == 1 and "layout version 9, which is newer" in r.stderr, r.stderr
    assert pins(pin) == before


def test_a_failed_compile_changes_nothing(netlab, tmp_path, monkeypatch):
    pin = netlab.pin_dir
    datapath.load(["cli0"], netlab.node, pin_dir=pin)
    before, prog = pins(pin), tc_prog(netlab.node, "cli0")
    bad = tmp_path / "kxlb.c"
    bad.write_text('#include "maps.h"\nint kxlb_tc(struct __sk_buff *skb) { return undeclared_thing; }\n')
    (tmp_path / "maps.h").write_text((comp.BPF_DIR / "maps.h").read_text())
    (tmp_path / "consts.h").write_text((comp.BPF_DIR / "consts.h").read_text())
    monkeypatch.setattr(comp, "MAIN_SOURCE", bad)
    with pytest.raises(KxlbError, match="undeclared_thing"):
        datapath.load(["cli0"], netlab.node, pin_dir=pin)
    assert pins(pin) == before and tc_prog(netlab.node, "cli0") == prog


def test_a_load_on_a_missing_interface_leaves_nothing(netlab):
    r = kxlb(netlab.pin_dir, "load", "--netns", netlab.node, "--iface", "cli0", "--iface", "nosuch0")
    assert r.returncode == 1 and "interface 'nosuch0' not found" in r.stderr
    assert not os.path.exists(netlab.pin_dir)
    assert tc_prog(netlab.node, "cli0") == ""


def test_a_device_without_ethernet_frames_is_refused_before_anything_changes(netlab):
    """A tun device (as WireGuard and IP tunnels) hands tc bare IP packets, which the
    datapath would parse as Ethernet: refused in one line, nothing compiled or attached."""
    subprocess.run(["ip", "-n", netlab.node, "tuntap", "add", "dev", "kxtun0", "mode", "tun"], check=True)
    try:
        r = kxlb(netlab.pin_dir, "load", "--netns", netlab.node, "--iface", "cli0", "--iface", "kxtun0")
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            "kxlb: error: interface 'kxtun0': link type 65534 is not Ethernet (a tun, WireGuard or IP tunnel "
            "device?); kxlb's programs parse Ethernet frames only"], r.stderr
        assert not os.path.exists(netlab.pin_dir)
        assert tc_prog(netlab.node, "cli0") == ""
    finally:
        subprocess.run(["ip", "-n", netlab.node, "link", "del", "kxtun0"], check=False)


def test_a_new_conntrack_capacity_keeps_open_connections(netlab):
    """A build with another conntrack size migrates the table: the open connections keep
    their backend and their reverse NAT through the new map."""
    lab, pin = netlab, netlab.pin_dir
    lab.start_servers(8080)
    ifaces = lab.node_ifaces
    datapath.load(ifaces, lab.node, pin_dir=pin)
    ok(kxlb(pin, "service", "add", f"{VIP}:80/tcp", *[f"{lab.backend_ip(i)}:8080" for i in range(3)]))
    holder = Holder(lab.client, [("tcp", VIP, 80)] * 6)
    try:
        prepared, _ = datapath.load(ifaces, lab.node, pin_dir=pin, extra_cflags=["-DKXLB_CT_ENTRIES=65536"])
        assert sorted(m.split(" (")[0] for m in prepared.migrated) == [  # sock_rev is sized like conntrack
            "conntrack: capacity 131072 -> 65536", "sock_rev: capacity 131072 -> 65536"]
        fd = bpfsys.obj_get(os.path.join(pin, current_pin("conntrack")))
        assert bpfsys.map_info(fd).max_entries == 65536
        os.close(fd)
        assert holder.ask("probe") == holder.first
    finally:
        holder.close()


# --- the way back: cleanup --------------------------------------------------------------------
def hooks_on(cgroup) -> list[str]:
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup], capture_output=True, text=True).stdout
    return sorted(p["name"] for p in json.loads(out.strip() or "[]"))


@pytest.mark.parametrize("how", [["cleanup"], ["controller", "--cleanup"]])
def test_cleanup_removes_what_a_release_without_a_record_left(netlab, old, how):
    """kxlb 0.1 in a DaemonSet kept its record in the pod's /run: after an uninstall,
    `unload` found nothing and the datapath kept translating. `kxlb cleanup` (and
    `kxlb controller --cleanup`, kube-proxy's flag) finds kxlb's programs, hooks and pins
    by name and removes them, and nothing else."""
    from kxlb.loader.registry import legacy_path

    lab, pin = netlab, netlab.pin_dir
    cgroup = f"/sys/fs/cgroup/unified/{lab.tag}"
    os.makedirs(cgroup)
    try:
        ifaces = [a for i in lab.node_ifaces for a in ("--iface", i)]
        ok(old_kxlb(old, pin, "load", "--netns", lab.node, *ifaces))
        r = subprocess.run([sys.executable, "-c", oldrelease.RUN_SOCKLB, str(old), pin, cgroup], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        from bcc import BPF
        other = BPF(text=b"int other_tool(struct __sk_buff *skb) { return -1; }")
        add_tc_filter(lab.node, "cli0", other.load_func(b"other_tool", BPF.SCHED_CLS).fd, 7)  # it stays
        os.unlink(legacy_path(pin))    # the record went with the pod
        assert hooks_on(cgroup) and tc_prog(lab.node, "cli0")
        r = ok(kxlb(pin, *how, "--netns", lab.node, "--cgroup", cgroup))
        assert tc_prog(lab.node, "cli0") == "" and all(tc_prog(lab.node, i, "egress") == "" for i in lab.node_ifaces)
        assert hooks_on(cgroup) == []
        assert not os.path.exists(pin)
        other = subprocess.run(["tc", "-n", lab.node, "filter", "show", "dev", "cli0", "ingress"], capture_output=True,
                               text=True).stdout
        assert "other_tool" in other
        ok(kxlb(pin, *how, "--netns", lab.node, "--cgroup", cgroup))  # idempotent
    finally:
        os.rmdir(cgroup)


def test_status_and_list_of_one_frontend(netlab):
    lab, pin = netlab, netlab.pin_dir
    lab.start_servers(8080)
    ok(kxlb(pin, "load", "--netns", lab.node, *[a for i in lab.node_ifaces for a in ("--iface", i)]))
    ok(kxlb(pin, "service", "add", f"{VIP}:80/tcp", f"{lab.backend_ip(0)}:8080", "--node-port",
            f"{lab.node_client_ip}:30080"))
    ok(kxlb(pin, "service", "add", f"{VIP}:81/tcp", f"{lab.backend_ip(1)}:8080"))
    ok(kxlb(pin, "service", "add", "10.96.5.2:80/tcp", f"{lab.backend_ip(2)}:8080"))
    config = BpfMap(os.path.join(pin, "config"), ctypes.c_uint32, V4.LbConfig)
    config.put(ctypes.c_uint32(0), DatapathConfig(snat_addrs=(lab.node_client_ip,), src_ports=(20000, 20999)).to_c(V4))
    config.close()
    holder = Holder(lab.client, [("tcp", VIP, 80)] + [("tcp", lab.node_client_ip, 30080)] * 3)  # 3 masqueraded
    subprocess.run(["ip", "netns", "exec", lab.client, "ping", "-c1", "-W1", "10.96.5.9"], capture_output=True)
    try:
        st = json.loads(ok(kxlb(pin, "status", "--json")).stdout)
        text = ok(kxlb(pin, "status")).stdout
    finally:
        holder.close()
    assert st["masquerade_ports"]["IPv4"] == {"range": [20000, 20999], "ports_in_use": 3, "ports": 1000, "flows": 3}
    assert "masquerade      IPv4 ports 20000-20999: 3 of 1000 in use   0.3% (3 flows)" in text
    assert [a["state"] for a in st["attachments"]] == ["ok"] * 4
    assert st["writer"] is None and st["interrupted_write"] is None
    assert st["maps"][current_pin("services")]["entries"] == 6  # 3 cluster IPs' ports, a NodePort, 2 markers
    assert st["maps"][current_pin("backends")]["entries"] == 3   # one slot per service port
    assert st["maps"][current_pin("conntrack")]["entries"] >= 1   # the client socket's record
    assert st["build"]["digest"]
    assert "attached        tc on cli0 in netns" in text and f"map             {current_pin('services')}" in text
    got = json.loads(ok(kxlb(pin, "list", f"{VIP}:80/tcp", "--json")).stdout)
    assert [(s["service"], s["backends"], [f["port"] for f in s["frontends"]]) for s in got] == [
        (f"{VIP}:80/tcp", [f"{lab.backend_ip(0)}:8080"], [80, 30080])]
    assert [s["service"] for s in json.loads(ok(kxlb(pin, "list", VIP, "--json")).stdout)] == [
        f"{VIP}:80/tcp", f"{VIP}:81/tcp"]
    assert [s["service"] for s in json.loads(ok(kxlb(pin, "list", f"{lab.node_client_ip}:30080", "--json")).stdout)] \
        == [f"{VIP}:80/tcp"]
    r = kxlb(pin, "list", "10.96.5.77")
    assert r.returncode == 1 and "no service has a frontend 10.96.5.77" in r.stderr
