"""How the lab stops the processes it started (no lab needed)."""
from __future__ import annotations

import subprocess
import time

import pytest

from kxlb.lab.procs import alive, group_members, proc_stat, stop


def test_stopping_a_leader_stops_what_it_forked():
    """A proxy that exits on SIGTERM may leave a child running (kube-proxy's
    iptables-restore, minutes into a large ruleset, holding the xtables lock): stopping
    the leader stops its whole process group, here a child that ignores SIGTERM."""
    leader = subprocess.Popen(["sh", "-c", "(trap '' TERM; exec sleep 300) & echo $!; wait"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    assert group_members(leader.pid) == sorted([leader.pid, child])
    assert stop({leader.pid: proc_stat(leader.pid)[1]}, grace=5.0) == []
    leader.wait(5)
    assert not alive(child), "the leader's child outlived it"
    assert group_members(leader.pid) == []


@pytest.mark.parametrize("hierarchy", ["unified", "cpu"])  # cgroup2 (cgroup.kill) and a v1 one
def test_kill_cgroup_removes_a_tree_while_a_supervisor_refills_it(hierarchy):
    """A node's cgroup holds its kubelet and nested pod cgroups. Killed pods get
    restarted by the supervisor still running above them, so killing leaf by leaf
    races it (CI once failed on EBUSY that way); kill_cgroup must win: every process
    dead, the tree gone."""
    import os
    import uuid
    from pathlib import Path

    from kxlb.lab.nodes import kill_cgroup

    root = Path("/sys/fs/cgroup") / hierarchy
    assert (root / "cgroup.procs").exists(), f"no cgroup hierarchy at {root}"
    top = root / f"kxt-kill-{uuid.uuid4().hex[:8]}"
    leaves = [top / "kubepods" / f"pod{i}" / "ctr" for i in range(3)]
    for leaf in leaves:
        leaf.mkdir(parents=True)
    # the "kubelet": keeps a sleeping "container" in every pod cgroup
    refill = "; ".join(f"[ -s {leaf}/cgroup.procs ] || {{ sleep 300 & echo $! > {leaf}/cgroup.procs; }}"
                       for leaf in leaves)
    supervisor = subprocess.Popen(["sh", "-c", f"echo $$ > {top}/cgroup.procs; while :; do {refill}; done"])
    try:
        deadline = time.monotonic() + 10
        while not all((leaf / "cgroup.procs").read_text().strip() for leaf in leaves):
            assert time.monotonic() < deadline, "the supervisor never filled the pod cgroups"
            time.sleep(0.02)
        kill_cgroup(str(top))
        assert not top.exists()
        assert supervisor.wait(5) == -9
    finally:
        supervisor.kill()
        if top.exists():
            kill_cgroup(str(top))
            for d in sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                os.rmdir(d)
