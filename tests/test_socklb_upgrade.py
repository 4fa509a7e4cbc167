"""The socket hooks through a load of a new build (loader/datapath.py switches every
recorded attachment to the staged programs, the socket hooks with
loader/socklb.py attach_sock_programs): one program per hook afterwards, in place
beside another tool's, and still translating the node's sockets and not a pod's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_socklb import JUDGED, PRELUDE, OtherTool, cgroup_programs

PORT = 8080


def kxlb(pin_dir, *args):
    r = subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


def run(cgroup: str, ns: str, code: str, *args) -> list:
    """``code`` as a process of ``cgroup`` in namespace ``ns``; the JSON lines it printed."""
    r = subprocess.run(["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec ip netns exec {ns} '
                        f'{sys.executable} -c "$0" "$@"', PRELUDE + code, *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.fixture
def cgroup(netlab):
    path = f"/sys/fs/cgroup/unified/{netlab.tag}"
    os.makedirs(path)
    yield path
    os.rmdir(path)


def test_a_load_of_a_new_build_replaces_the_hooks_in_place_and_keeps_their_namespace(netlab, cgroup):
    """A controller attached the hooks for the node's namespace beside another tool's
    connect4 program; `kxlb load` of another build (a new conntrack size: compile,
    migrate, switch) puts its programs in their places: one per hook, after the other
    tool's as before, the node's namespace carried over (node processes translated and
    judged as the node, a pod's sockets left to tc and judged as the pod)."""
    from kxlb.loader.maps import Maps
    from kxlb.loader.services import DatapathConfig, ServiceTable
    from kxlb.loader.attach import prog_ref
    from kxlb.loader.socklb import BPF_F_ALLOW_MULTI, attach_socket_lb, pinned_sock_programs

    lab, pin = netlab, netlab.pin_dir
    lab.start_servers(PORT)
    ifaces = [a for i in lab.node_ifaces for a in ("--iface", i)]
    kxlb(pin, "load", "--netns", lab.node, *ifaces)
    tool = OtherTool()
    tool.attach("other_connect4", cgroup, BPF_F_ALLOW_MULTI)
    attach_socket_lb(pin, cgroup, lab.node)  # as `kxlb controller --netns NODE --cgroup DIR` does
    with Maps.open(pin) as maps:  # external frontends masquerade to the node's address toward the pod
        ServiceTable(maps).set_config(DatapathConfig(snat_addrs=(lab.node_client_ip,),
                                                     node_addrs=(lab.node_client_ip,)))
    be = f"{lab.backend_ip(2)}:{PORT}"
    for proto, port in (("tcp", 80), ("udp", 53)):
        kxlb(pin, "service", "add", f"10.96.11.1:{port}/{proto}", be, "--load-balancer-ip", "10.96.11.11",
             "--source-range", f"{lab.client_ip}/32")
        kxlb(pin, "service", "add", f"10.96.11.2:{port}/{proto}", be, "--load-balancer-ip", "10.96.11.12",
             "--source-range", f"{lab.node_client_ip}/32")
    judged = {"pod": [[["be2", "10.96.11.11"]] * 2, ["no answer"] * 2],
              "node": [["ETIMEDOUT"] * 2, [["be2", "10.96.11.12"]] * 2]}

    def check():
        progs = cgroup_programs(cgroup)
        assert sorted(n for _, n, _ in progs if n.startswith("kxlb_")) == sorted(
            f"kxlb_{h}{f}" for h in ("connect", "sendmsg", "recvmsg", "getpeername") for f in "46")
        assert {f for _, _, f in progs} == {"multi"}
        assert [n for t, n, _ in progs if t == "cgroup_inet4_connect"] == ["other_connect4", "kxlb_connect4"]
        before = tool.calls
        assert run(cgroup, lab.client, JUDGED, "v4", "10.96.11.11", "10.96.11.12") == judged["pod"]
        assert run(cgroup, lab.node, JUDGED, "v4", "10.96.11.11", "10.96.11.12") == judged["node"]
        assert tool.calls == before + 4  # each TCP connect(), pod's and node's

    check()
    old = pinned_sock_programs(pin)
    old_ids = {prog_ref(fd).id for fd in old.values()}
    out = kxlb(pin, "load", "--netns", lab.node, *ifaces, "--conntrack-max", "65536")
    assert f"{len(lab.node_ifaces) + 1} earlier attachments now run this build" in out, out
    check()
    new = pinned_sock_programs(pin)
    ids = {p["id"] for p in json.loads(subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup],
                                                        capture_output=True, text=True).stdout)
           if p["name"].startswith("kxlb_")}
    assert ids == {prog_ref(fd).id for fd in new.values()} and not ids & old_ids
    for fd in (*old.values(), *new.values()):
        os.close(fd)
    kxlb(pin, "unload")
    assert [n for _, n, _ in cgroup_programs(cgroup)] == ["other_connect4"]
