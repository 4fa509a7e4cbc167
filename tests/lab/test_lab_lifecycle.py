"""`kxlb lab up` / `down` twice in a row, leaving nothing behind (runs last: it takes the
session lab down)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kxlb.lab.cluster import MARKER_ENV, Lab
from kxlb.lab.controlplane import MARKER_ENV as CP_MARKER, _port_busy
from kxlb.lab.procs import marked_pids as procs_marked
from kxlb.lab.nodes import netns_list


def _leftovers(lab) -> list[str]:
    out, name = [], lab.name
    wd = str(lab.workdir)
    out += [f"process {p} ({MARKER_ENV})" for p in procs_marked(MARKER_ENV, wd)]
    out += [f"process {p} ({CP_MARKER})" for p in procs_marked(CP_MARKER, wd)]
    out += [f"netns {n}" for n in netns_list() if n.startswith(f"{name}-")]
    out += [f"interface {i}" for i in os.listdir("/sys/class/net") if i.startswith(name)]
    out += [f"pin dir {d}" for d in os.listdir("/sys/fs/bpf") if d.startswith(f"{name}-")]
    if os.path.exists(lab.topology.cgroup_dir):
        out.append(f"cgroup {lab.topology.cgroup_dir}")
    out += [f"registry {f}" for f in (os.listdir("/run/kxlb") if os.path.isdir("/run/kxlb") else [])
            if f"{name}-node" in f]
    if _port_busy(lab.api_port):
        out.append(f"port {lab.api_port}")
    return out


def _kxlb(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "kxlb", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, f"kxlb {' '.join(args)}: {r.stderr}"
    return r


@pytest.mark.lab_lifecycle
@pytest.mark.timeout(300)
def test_lab_up_and_down_twice_leaves_nothing(lab):
    """The session lab is the first `up`; down, up again with the CLI, leave things for
    down to find (a datapath with pins, processes in the node cgroup and the client
    namespace), down again."""
    wd = ["--workdir", str(lab.workdir)]
    up = ["lab", "up", *wd, "--name", lab.name, "--port-offset", str(lab.port_offset), "--proxy", "none", "--no-build"]
    assert lab.status()["up"]
    t0 = time.monotonic()
    lab.down()
    print(f"first down: {time.monotonic() - t0:.1f}s")
    assert _leftovers(lab) == []

    t0 = time.monotonic()
    _kxlb(*up)
    print(f"second up (CLI): {time.monotonic() - t0:.1f}s")
    st = json.loads(_kxlb("lab", "status", "--json", *wd).stdout)
    assert st["up"] and st["proxy"] == "none" and len(st["nodes"]) == 2
    # Idempotent: up again changes nothing.
    pids = [n["daemons"]["agent"]["pid"] for n in st["nodes"]]
    _kxlb(*up)
    assert [n["daemons"]["agent"]["pid"] for n in json.loads(_kxlb("lab", "status", "--json", *wd).stdout)["nodes"]] == pids

    n1 = lab.node(1)
    _kxlb("--pin-dir", n1.pin_dir, "load", "--netns", n1.netns, "--iface", "eth0")
    assert os.path.isdir(n1.pin_dir)
    stray = [subprocess.Popen([sys.executable, "-m", "kxlb", "lab", "exec", *wd, target, "--", "sleep", "600"],
                              start_new_session=True) for target in (f"node/{n1.name}", "client")]
    time.sleep(0.5)
    assert all(p.poll() is None for p in stray)

    t0 = time.monotonic()
    _kxlb("lab", "down", *wd)
    print(f"second down (CLI): {time.monotonic() - t0:.1f}s")
    for p in stray:
        p.wait(timeout=10)
    assert _leftovers(lab) == []
    r = _kxlb("lab", "status", *wd, check=False)
    assert r.returncode == 3 and "is down" in r.stdout
    assert Lab.from_workdir(lab.workdir).name == lab.name  # down keeps the lab's identity
    _kxlb("lab", "down", *wd)  # idempotent
