"""Which source ports masqueraded flows get (controller/node.py): outside the node's
ip_local_port_range and the cluster's NodePort range. kxlb 0.2 took the part of
1024-65535 outside the ephemeral range alone, which with Linux's defaults held the whole
NodePort range: a backend's reply to a masquerade port that was also a live NodePort was
taken for a new connection to the NodePort."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kxlb.controller.node import masquerade_port_range
from kxlb.lab.netlab import unique_tag
from kxlb.loader.errors import KxlbError


@pytest.fixture
def ns():
    name = unique_tag()
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], check=True)


def ephemeral(ns, lo, hi):
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.ip_local_port_range={lo} {hi}"], check=True)


@pytest.mark.parametrize("eph, node_ports, want", [
    ((32768, 60999), (30000, 32767), (1024, 29999)),     # Linux's and Kubernetes' defaults
    ((1024, 29999), (30000, 32767), (32768, 65535)),
    ((40000, 65000), (30000, 32767), (1024, 29999)),
    ((32768, 60999), (20000, 22767), (1024, 19999)),     # a custom NodePort range
])
def test_the_largest_range_outside_the_ephemeral_ports_and_the_nodeports(ns, eph, node_ports, want):
    ephemeral(ns, *eph)
    assert masquerade_port_range(ns, node_ports) == want


@pytest.mark.parametrize("explicit, what", [((30000, 31000), "the NodePort range"),
                                            ((50000, 51000), "ip_local_port_range")])
def test_an_explicit_range_overlapping_either_is_refused(ns, explicit, what):
    ephemeral(ns, 32768, 60999)
    with pytest.raises(KxlbError, match=what):
        masquerade_port_range(ns, (30000, 32767), explicit)
    assert masquerade_port_range(ns, (30000, 32767), (61000, 65535)) == (61000, 65535)


def test_the_controller_refuses_a_bad_range_in_one_line():
    r = subprocess.run([sys.executable, "-m", "kxlb", "controller", "--node-name", "n1", "--masquerade-ports",
                        "30000-31000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "overlaps the NodePort range" in r.stderr, r.stderr
