"""The IPv6 datapath fuzzed through BPF_PROG_TEST_RUN on both hooks (tests/fuzz6.py says
what is generated and what the oracle demands). FUZZ_FRAMES (default 100000, both hooks
together) and FUZZ_SEED choose the run, as for the IPv4 half (tests/test_fuzz.py). One
test per category, so a failure names where it was found, with reproducers."""
from __future__ import annotations

import os

import pytest
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import ICMPv6DestUnreach, IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop
from scapy.layers.l2 import Ether

import fuzz
import fuzz6
from harness import clean_table

FRAMES = int(os.environ.get("FUZZ_FRAMES", "100000"))
SEED = int(os.environ.get("FUZZ_SEED", "8"))


@pytest.fixture(scope="module")
def table(dp):
    with clean_table(dp[1]) as t:
        fuzz6.install_services(t)
        yield t


@pytest.fixture(scope="module")
def fuzzed(dp, table):
    datapath, _ = dp
    runners = {"tc": fuzz.Runner("tc", datapath.tc_fd), "xdp": fuzz.Runner("xdp", datapath.xdp_fd)}
    fz = fuzz6.Fuzzer6(table, runners, SEED)
    for hook in runners:
        fuzz.run(fz, hook, FRAMES // len(runners))
    return fz


def _scapy_sums(frame: bytes) -> Ether:
    """The frame with its L4/ICMPv6 checksums as scapy computes them."""
    p = Ether(frame)
    for layer in (TCP, UDP, ICMPv6DestUnreach):
        if layer in p:
            del p[layer].chksum
    return Ether(bytes(p))


def test_ipv6_builders_and_checker_agree_with_scapy():
    """Frames with extension headers and an ICMPv6 error quoting a whole packet: the
    builder's checksums are scapy's, the checker finds them valid and catches a flip."""
    fl = fuzz6.Flow6(fuzz.TCP, fuzz6.PODS6[0], 40000, fuzz6.CIP6, 80, fuzz6.BACKENDS6[0], fuzz6.PODS6[0], 40000)
    chain = fuzz6.ext(fuzz6.DSTOPTS, fuzz6.HOP, 0) + fuzz6.ext(fuzz.TCP, fuzz6.DSTOPTS, 1)
    samples = {
        "tcp": fl.forward(b"hello"),
        "udp": fuzz6.packet6(fuzz6.PODS6[1], fuzz6.CIP6, fuzz.UDP, fuzz.udp(5, 53, b"odd")),
        "ext": fl.forward(b"x", exts=chain, first=fuzz6.HOP),
        "icmp error": fuzz6.packet6(fuzz6.BACKENDS6[0], fuzz6.PODS6[0], fuzz6.ICMP6,
                                    fuzz6.icmp6(1, 4, fl.at_backend(b"abc"))),
    }
    for name, frame in samples.items():
        frame = bytes(frame)
        assert bytes(_scapy_sums(frame)) == frame, name
        p = fuzz6.parse6(frame)
        assert p.ok, (name, p.why)
        sums = fuzz6.checksums6(frame, p)
        assert sums and all(sums.values()), (name, sums)
        bad = bytearray(frame)
        bad[p.end - 1] ^= 0x10
        assert not all(fuzz6.checksums6(bytes(bad), p).values()), name
    ext = Ether(bytes(samples["ext"]))
    assert IPv6ExtHdrHopByHop in ext and IPv6ExtHdrDestOpt in ext and ext[TCP].dport == 80
    assert "quoted l4" in fuzz6.checksums6(bytes(samples["icmp error"]), fuzz6.parse6(bytes(samples["icmp error"])))
    assert Ether(bytes(samples["icmp error"]))[IPv6].nh == 58


@pytest.mark.parametrize("hook", ["tc", "xdp"])
def test_fuzz6_ran_every_path(fuzzed, hook, capsys):
    """Every outcome reached, every category generated, translations in the categories
    meant to translate: a broken set-up cannot pass as 'nothing failed'."""
    if hook == "tc":
        with capsys.disabled():
            print("\n" + fuzz.report(fuzzed))
    counts = fuzzed.counts[hook]
    assert fuzzed.judged[hook] >= FRAMES // 2
    by_outcome = {o: sum(n for (_, oo), n in counts.items() if oo == o)
                  for o in ("untouched", "rewritten", "dropped", "rejected")}
    assert all(n > FRAMES // 400 for n in by_outcome.values()), by_outcome
    for cat in fuzz6.CATEGORIES:
        assert sum(n for (c, _), n in counts.items() if c == cat) > 0, f"category {cat} never generated"
    for cat in ("setup", "valid", "byte flips", "extension headers", "icmpv6 error (tracked flow)",
                "fragments in order", "truncate+payload length"):
        assert counts[(cat, "rewritten")] > 0, f"{cat}: nothing translated"
    assert counts[("control messages", "untouched")] > 0 and not counts[("control messages", "rewritten")]
    assert set(fuzzed.failures) <= set(fuzz6.CATEGORIES), set(fuzzed.failures)


@pytest.mark.parametrize("category", fuzz6.CATEGORIES)
def test_fuzz6(fuzzed, category):
    failures = fuzzed.failures.get(category, [])
    shown = "\n".join(str(f) for f in failures[:5])
    assert not failures, f"{fuzzed.failed[category]} frames failed the oracle in {category!r} (seed {SEED}):\n{shown}"
