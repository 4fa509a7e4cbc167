"""How the lab stops the processes it started (no lab needed)."""
from __future__ import annotations

import subprocess

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
