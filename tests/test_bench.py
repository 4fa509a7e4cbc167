"""bench/prog_run.py's own parts: its frames are what scapy builds (so the checksums are
right and kxlb and Katran time valid packets), and its checks refuse a cell whose
frames did not take the path the row names (a benchmark that silently timed drops or
established flows as "new flows" would be worse than none)."""
from __future__ import annotations

import subprocess

import sys
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import frames  # noqa: E402
import prog_run  # noqa: E402
from testrun import prebuilt, time_frames  # noqa: E402


def scapy_frame(l4, src, dst):
    return bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IP(src=src, dst=dst, id=1) /
                 l4 / frames.PAYLOAD)


@pytest.mark.parametrize("flags", [frames.SYN, frames.ACK])
def test_tcp_frame_is_scapys(flags):
    got = frames.tcp("10.64.3.1", 1234, "10.200.1.1", 80, flags)
    assert got == scapy_frame(TCP(sport=1234, dport=80, flags=flags, window=8192), "10.64.3.1", "10.200.1.1")
    assert frames.ip_dst(got) == ("10.200.1.1", 80) and frames.ip_src(got) == ("10.64.3.1", 1234)


def test_udp_frame_is_scapys():
    got = frames.udp("172.100.0.1", 5000, "10.99.0.3", 53)
    assert got == scapy_frame(UDP(sport=5000, dport=53), "172.100.0.1", "10.99.0.3")


def test_ipv6_frames_are_scapys():
    from scapy.layers.inet6 import IPv6

    def six(l4, src, dst):
        return bytes(Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / IPv6(src=src, dst=dst, hlim=64) /
                     l4 / frames.PAYLOAD)
    got = frames.tcp("fd00:64::1", 1234, "fd00:99::1", 80, frames.SYN)
    assert got == six(TCP(sport=1234, dport=80, flags=frames.SYN, window=8192), "fd00:64::1", "fd00:99::1")
    assert frames.ip_dst(got) == ("fd00:99::1", 80) and frames.ip_src(got) == ("fd00:64::1", 1234)
    assert frames.udp("fd00:64::1", 5000, "fd00:99::3", 53) == six(UDP(sport=5000, dport=53), "fd00:64::1",
                                                                  "fd00:99::3")
    assert frames.fresh_clients("fd00:64", 50_001)[-1] == ("fd00:64::1:1", 1024)


def test_fresh_clients_are_distinct_in_katrans_order():
    c = frames.fresh_clients("10.64", 120_000)
    assert len(set(c)) == 120_000
    assert c[0] == ("10.64.0.1", 1024) and c[49_999] == ("10.64.0.1", 51023) and c[50_000] == ("10.64.1.1", 1024)
    with pytest.raises(ValueError, match="10.64"):
        frames.fresh_clients("10.64", 50_000 * 256 + 1)


@pytest.fixture(scope="module")
def ref():
    return prog_run.Reference()


def test_kxlb_round_measures_every_row(ref):
    """The kxlb half of kxlb vs Katran on a fresh datapath: every cell passes its checks
    (verdict, destination, counters) and gives a figure above the empty program's floor."""
    got = prog_run.kxlb_round(prog_run.MAIN_SOURCE, ref, calls=300)
    for hook in prog_run.HOOKS:
        floor = got[hook, "empty"]
        assert floor > 0
        for row in ("non_vip", "established", "new_flow_syn", "new_flow_ack"):
            assert got[hook, row] > floor, (hook, row, got)


def test_path_mtu_rows_are_each_checked():
    """The pmtu section: every row's frames were translated and masqueraded (timed_cell's
    checks), on both hooks, and the namespace it timed them in is gone."""
    class Bar:
        def update(self, n):
            pass

    rows = prog_run.path_mtu(prog_run.MAIN_SOURCE, calls=50, rounds=1, bar=Bar())
    assert {(r["packet"], r["hook"]) for r in rows} == {(name, h) for name, _, _ in prog_run.PMTU_ROWS
                                                         for h in prog_run.HOOKS}
    assert all(r["ns"].median > 0 for r in rows)
    assert "-bench" not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout


def test_cells_refuse_the_wrong_path(ref):
    """Established frames timed as new flows, a rewritten frame timed as untouched, and
    a wrong destination are each refused."""
    vip, be = ("10.200.1.1", 80), {("10.0.0.1", 80)}
    est = frames.tcp("10.9.9.9", 40000, *vip)
    new = [frames.tcp(a, p, *vip) for a, p in frames.fresh_clients("10.64", 50)]
    with prog_run.kxlb_datapath(prog_run.MAIN_SOURCE) as k:
        k.table.add_many([prog_run.LbService.simple(prog_run.ServiceKey(*vip, 6), [prog_run.Backend(*next(iter(be)))])])
        fd = k.fd["xdp"]
        prog_run.timed_cell("track", k, fd, prebuilt([est]), hook="xdp", last=est, to=be, hits="new")
        with pytest.raises(prog_run.Wrong, match="datapath counted"):
            prog_run.timed_cell("est as new", k, fd, prebuilt([est] * 5), hook="xdp", last=est, to=be, hits="new")
        with pytest.raises(prog_run.Wrong, match="datapath counted"):
            prog_run.timed_cell("new as est", k, fd, prebuilt(new), hook="xdp", last=new[-1], to=be, hits="ct_fwd")
        with pytest.raises(prog_run.Wrong, match="rewritten"):
            prog_run.timed_cell("untouched?", k, fd, prebuilt([est]), hook="xdp", last=est, untouched=True)
        with pytest.raises(prog_run.Wrong, match="went to"):
            prog_run.timed_cell("elsewhere", k, fd, prebuilt([est]), hook="xdp", last=est, to={("10.0.0.9", 80)})
        # the same frames through the empty program: untouched, as the floor row claims
        t = time_frames(ref.empty["xdp"], prebuilt([est] * 3))
        assert t.out == est and len(t.ns) == 3
