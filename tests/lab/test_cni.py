"""The lab's CNI plugin (lab/cni.py), called as a runtime calls it: environment, config
on stdin, a real pod network namespace; the veth, addresses and routes it makes are read
back from the kernel."""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from kxlb.lab import cni
from kxlb.loader.netns import netns
from kxlb.lab.nodes import NodeSpec, Topology

def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def node_ns(tmp_path):
    """A node namespace (the plugin runs inside it, as under containerd) and a spec
    whose podCIDR is a /29: five addresses for pods besides the gateway."""
    if os.geteuid() != 0:
        pytest.fail("the CNI tests must run as root (network namespaces)")  # as the other lab tests: never skip
    tag = uuid.uuid4().hex[:6]
    name = f"kxcni-{tag}"
    sh("ip", "netns", "add", name)
    spec = NodeSpec(name=name, index=1, ip="10.250.0.11", pod_cidr="10.244.1.0/29", gateway="10.244.1.1",
                    cgroup="", pin_dir="", zone="z", ip6="fd00:10:250::b", pod_cidr6="fd00:10:244:1::/64")
    pods = []

    def pod() -> str:
        p = f"/var/run/netns/kxcnipod-{tag}-{len(pods)}"
        sh("ip", "netns", "add", os.path.basename(p))
        pods.append(p)
        return p

    yield name, spec, pod
    for p in pods:
        subprocess.run(["ip", "netns", "del", os.path.basename(p)], capture_output=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def call(node: str, conf: dict, command: str, cid: str = "", netns: str = "") -> tuple[int, dict]:
    """The plugin as an executable, inside the node's namespace."""
    env = {"PATH": os.environ["PATH"], "CNI_COMMAND": command, "CNI_CONTAINERID": cid, "CNI_NETNS": netns,
           "CNI_IFNAME": "eth0", "CNI_PATH": "/nonexistent"}
    r = subprocess.run(["ip", "netns", "exec", node, sys.executable, "-m", "kxlb.lab.cni"], input=json.dumps(conf),
                       capture_output=True, text=True, env=env)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}


def config(spec: NodeSpec, state: Path) -> dict:
    return {"cniVersion": "1.0.0", "name": "kxlab", "type": "kxlb-cni", "stateDir": str(state), "node": asdict(spec)}


def test_add_wires_the_routed_veth_and_del_undoes_it(node_ns, tmp_path):
    node, spec, new_pod = node_ns
    conf = config(spec, tmp_path)
    netns_path, cid = new_pod(), uuid.uuid4().hex * 2
    rc, res = call(node, conf, "ADD", cid, netns_path)
    assert rc == 0, res
    veth = Topology.pod_veth(cid)
    ip4 = res["ips"][0]["address"].split("/")[0]
    ip6 = res["ips"][1]["address"].split("/")[0]
    assert ipaddress.ip_address(ip4) in ipaddress.ip_network(spec.pod_cidr) and ip4 != spec.gateway
    assert ip6 == spec.pod_ip6(ip4)
    assert res["interfaces"][0]["name"] == veth and res["interfaces"][1] == {"name": "eth0", "sandbox": netns_path}
    # Node side: the gateway on the veth, a host route to the pod through it.
    assert f"{spec.gateway}/32" in sh("ip", "-n", node, "addr", "show", "dev", veth)
    assert f"dev {veth}" in sh("ip", "-n", node, "route", "get", ip4)
    assert f"dev {veth}" in sh("ip", "-n", node, "-6", "route", "get", ip6)
    # Pod side: its addresses and a default route via the gateway, both families.
    pod_addrs = sh("nsenter", f"--net={netns_path}", "ip", "addr", "show", "dev", "eth0")
    assert f"{ip4}/32" in pod_addrs and f"{ip6}/128" in pod_addrs
    assert f"default via {spec.gateway} dev eth0" in sh("nsenter", f"--net={netns_path}", "ip", "route")
    assert f"default via {spec.gateway6} dev eth0" in sh("nsenter", f"--net={netns_path}", "ip", "-6", "route")
    # Traffic: the node connects to a listener in the pod, over the veth, both families.
    for addr, family in ((ip4, socket.AF_INET), (ip6, socket.AF_INET6)):
        with netns(netns_path):
            srv = socket.socket(family, socket.SOCK_STREAM)
        with netns(node):
            cli = socket.socket(family, socket.SOCK_STREAM)
        with srv, cli:
            srv.bind((addr, 8080))
            srv.listen(1)
            cli.settimeout(3)
            cli.connect((addr, 8080))
            peer = srv.accept()[1][0]
            assert peer == (spec.gateway if family == socket.AF_INET else spec.gateway6)
    assert call(node, conf, "CHECK", cid, netns_path)[0] == 0

    rc, res = call(node, conf, "DEL", cid, netns_path)
    assert rc == 0 and res == {}
    assert subprocess.run(["ip", "-n", node, "link", "show", veth], capture_output=True).returncode != 0
    assert not (tmp_path / "ipam" / ip4).exists() and not (tmp_path / "ipam" / ip6).exists()
    # DEL is idempotent (runtimes retry it); CHECK of an unknown container is error 3.
    assert call(node, conf, "DEL", cid, netns_path)[0] == 0
    rc, res = call(node, conf, "CHECK", cid, netns_path)
    assert rc == 1 and res["code"] == cni.E_CONTAINER_UNKNOWN


def test_addresses_are_unique_round_robin_and_run_out_cleanly(node_ns, tmp_path):
    node, spec, new_pod = node_ns
    conf = config(spec, tmp_path)
    got = []
    for _ in range(5):  # a /29: .2 to .6 (.1 is the gateway)
        rc, res = call(node, conf, "ADD", uuid.uuid4().hex, new_pod())
        assert rc == 0, res
        got.append(res["ips"][0]["address"])
    assert sorted(got) == [f"10.244.1.{i}/32" for i in range(2, 7)]
    rc, res = call(node, conf, "ADD", uuid.uuid4().hex, new_pod())
    assert rc == 1 and res["code"] == cni.E_TRY_LATER and "no free address" in res["msg"]
    # The failed ADD left nothing behind: still five pod veths.
    assert sh("ip", "-n", node, "link").count(": kxp") == 5


def test_gc_removes_attachments_the_runtime_no_longer_lists(node_ns, tmp_path):
    node, spec, new_pod = node_ns
    conf = config(spec, tmp_path)
    keep, drop = uuid.uuid4().hex, uuid.uuid4().hex
    for cid in (keep, drop):
        assert call(node, conf, "ADD", cid, new_pod())[0] == 0
    gc = dict(conf, **{"cniVersion": "1.1.0", "cni.dev/valid-attachments": [{"containerID": keep, "ifname": "eth0"}]})
    assert call(node, gc, "GC")[0] == 0
    links = sh("ip", "-n", node, "link")
    assert Topology.pod_veth(keep) in links and Topology.pod_veth(drop) not in links
    assert sorted(set(p.read_text() for p in (tmp_path / "ipam").iterdir()
                      if not p.name.startswith((".", "cursor")))) == [keep]


@pytest.mark.parametrize("stdin, env, code", [
    ("{not json", {"CNI_COMMAND": "ADD"}, cni.E_DECODE),
    (json.dumps({"cniVersion": "9.9.9"}), {"CNI_COMMAND": "ADD"}, cni.E_INCOMPATIBLE),
    (json.dumps({"cniVersion": "1.0.0", "stateDir": "/tmp"}), {"CNI_COMMAND": "ADD"}, cni.E_INVALID_ENV),
    (json.dumps({"cniVersion": "1.0.0", "stateDir": "/tmp"}),
     {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c", "CNI_NETNS": "/x", "CNI_IFNAME": "eth0"}, cni.E_INVALID_CONFIG),
    ("{}", {"CNI_COMMAND": "FROB"}, cni.E_INVALID_ENV),
])
def test_bad_input_is_a_spec_error_object(stdin, env, code):
    rc, out = cni.main(stdin, env)
    assert rc == 1 and out["code"] == code and out["msg"]


def test_version():
    rc, out = cni.main("", {"CNI_COMMAND": "VERSION"})
    assert rc == 0 and "1.0.0" in out["supportedVersions"]
