"""The datapath fuzzed through BPF_PROG_TEST_RUN on both hooks (tests/fuzz.py says what
is generated and what the oracle demands). FUZZ_FRAMES (default 100000, both hooks
together) and FUZZ_SEED choose the run; `make fuzz` runs a million frames. Counts per
category, outcome and verdict are printed.

One test per category, so a new failure names where it was found, with reproducers
(frame bytes in and out, hook). Bugs already known are matched narrowly, counted apart
and kept visible by tests marked xfail(strict=True): when the bug is fixed they pass,
pytest reports the strict XPASS as a failure, and the entry in fuzz.KNOWN_BUGS goes.
"""
from __future__ import annotations

import os

import pytest

import fuzz
from harness import clean_table, IP, Ether, IPerror, assert_checksums

FRAMES = int(os.environ.get("FUZZ_FRAMES", "100000"))
SEED = int(os.environ.get("FUZZ_SEED", "8"))


@pytest.fixture(scope="module")
def table(dp):
    with clean_table(dp[1]) as t:
        fuzz.install_services(t)
        yield t


@pytest.fixture(scope="module")
def fuzzed(dp, table):
    """One seeded run over both hooks (tc first, then XDP), judged frame by frame."""
    datapath, _ = dp
    runners = {"tc": fuzz.Runner("tc", datapath.tc_fd), "xdp": fuzz.Runner("xdp", datapath.xdp_fd)}
    fz = fuzz.Fuzzer(table, runners, SEED)
    for hook in runners:
        fuzz.run(fz, hook, FRAMES // len(runners))
    return fz


# --- the oracle's own tools, checked against scapy ---------------------------------------------
def _samples():
    flow = fuzz.Flow(fuzz.TCP, fuzz.PODS[0], 40000, fuzz.CIP, 80, fuzz.BACKENDS[0], fuzz.PODS[0], 40000)
    uflow = fuzz.Flow(fuzz.UDP, fuzz.PODS[1], 40001, fuzz.CIP, 53, fuzz.BACKENDS[1], fuzz.PODS[1], 40001)
    err = fuzz.icmp(3, 3, flow.at_backend(b"abc"))
    return {
        "tcp": flow.forward(b"hello"),
        "tcp-options": fuzz.packet(fuzz.PODS[0], fuzz.CIP, fuzz.TCP, fuzz.tcp(1, 80, options=b"\x02\x04\x05\xb4"),
                                   options=b"\x01\x01\x01\x00"),
        "udp": uflow.forward(b"odd"),
        "udp-zero": fuzz.packet(fuzz.PODS[0], fuzz.CIP, fuzz.UDP, fuzz.udp(1, 53, b"x", csum=False)),
        "echo": fuzz.packet(fuzz.PODS[0], fuzz.CIP, fuzz.ICMP, fuzz.icmp(8, 0, b"ping", 7)),
        "icmp-error-full-quote": fuzz.packet(fuzz.BACKENDS[0], fuzz.PODS[0], fuzz.ICMP, err),
        "icmp-error-28": fuzz.packet(fuzz.BACKENDS[0], fuzz.PODS[0], fuzz.ICMP, fuzz.icmp(3, 3, flow.at_backend()[:28])),
        "trailing": uflow.forward(b"q") + b"\xff" * 9,
    }


@pytest.mark.parametrize("name", list(_samples()))
def test_fast_checksums_agree_with_scapy(name):
    """The fuzzer's frame builder and checksum checker against scapy: built frames pass
    harness.assert_checksums; the checker finds every checksum valid, and invalid once a
    covered byte changes."""
    frame = bytes(_samples()[name])
    assert_checksums(frame)
    p = fuzz.parse(frame)
    sums = fuzz.checksums(frame, p)
    assert sums and all(sums.values()), sums
    if name == "icmp-error-full-quote":
        assert {"icmp", "quoted ip", "quoted l4"} <= set(sums)
        quoted = IP(bytes(Ether(frame)[IPerror]))  # the whole packet is quoted: scapy checks it as a packet
        assert_checksums(bytes(Ether(src=fuzz.CLIENT_MAC.hex(":"), dst=fuzz.NODE_MAC.hex(":")) / quoted))
    covered = p.l4 if "udp zero" in sums else p.end  # a UDP packet without checksum: the IP header only
    for i in range(14, covered):
        if i in (24, 25):  # flipping a checksum byte alone is caught too, just by a different sum
            continue
        bad = bytearray(frame)
        bad[i] ^= 0x10
        bp = fuzz.parse(bytes(bad))
        if not bp.ok or bp.fragment or bp.end != p.end or bp.l4 != p.l4 or bp.proto != p.proto:
            continue
        after = fuzz.checksums(bytes(bad), bp)
        assert not all(after.get(k, True) for k in sums if k != "udp zero"), f"byte {i} changed, sums {after}"


def test_harness_checks_the_quoted_l4_checksum_of_a_whole_quote():
    """harness.assert_checksums judges the quoted TCP checksum when the whole packet is
    quoted (the fuzzer's checker does too): a wrong one is caught."""
    frame = bytearray(_samples()["icmp-error-full-quote"])
    frame[14 + 20 + 8 + 20 + 16] ^= 0x01            # the quoted TCP checksum
    fuzz.fix_l4(frame, 14)                           # outer ICMP checksum right again
    with pytest.raises(AssertionError, match="quoted TCP checksum"):
        assert_checksums(bytes(frame))
    assert fuzz.checksums(bytes(frame), fuzz.parse(bytes(frame)))["quoted l4"] is False


def test_fast_checker_bounds_checksums_by_the_total_length():
    """Trailing bytes are not part of any checksum: changing them leaves every sum valid,
    as the receiver (which trims to tot_len) sees it; and scapy agrees."""
    frame = bytearray(_samples()["icmp-error-28"]) + bytes(12)
    frame[-3] = 0x42
    sums = fuzz.checksums(bytes(frame), fuzz.parse(bytes(frame)))
    assert all(sums.values())
    assert_checksums(bytes(frame))


# --- the run -------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", ["tc", "xdp"])
def test_fuzz_ran_every_path(fuzzed, hook, capsys):
    """Counts printed; the run reached every outcome in the categories meant to reach it,
    so a broken set-up cannot pass as 'nothing failed'."""
    if hook == "tc":
        with capsys.disabled():
            print("\n" + fuzz.report(fuzzed))
    counts = fuzzed.counts[hook]
    assert fuzzed.judged[hook] >= FRAMES // 2
    outcomes = ("untouched", "rewritten", "dropped", "rejected")
    by_outcome = {o: sum(n for (_, oo), n in counts.items() if oo == o) for o in outcomes}
    assert all(n > FRAMES // 200 for n in by_outcome.values()), by_outcome
    for cat in fuzz.CATEGORIES:
        assert sum(n for (c, _), n in counts.items() if c == cat) > 0, f"category {cat} never generated"
    for cat in ("setup", "valid", "byte flips", "icmp error (tracked flow)", "fragments in order", "ip options",
                "udp checksum edge", "truncate+tot_len"):
        assert counts[(cat, "rewritten")] > 0, f"{cat}: nothing translated"
    assert counts[("valid", "rejected")] > 0 and counts[("valid", "dropped")] > 0
    assert set(fuzzed.failures) <= set(fuzz.CATEGORIES), set(fuzzed.failures)


@pytest.mark.parametrize("category", fuzz.CATEGORIES)
def test_fuzz(fuzzed, category):
    failures = fuzzed.failures.get(category, [])
    shown = "\n".join(str(f) for f in failures[:5])
    assert not failures, f"{fuzzed.failed[category]} frames failed the oracle in {category!r} (seed {SEED}):\n{shown}"


@pytest.mark.parametrize("bug", [pytest.param(b.name, marks=pytest.mark.xfail(strict=True, reason=b.reason))
                                 for b in fuzz.KNOWN_BUGS] or ["none registered"])
def test_fuzz_known_bug_still_found(fuzzed, bug):
    """A known bug's frames are counted apart; its test is xfail(strict=True), so it
    fails the run once the fuzzer no longer finds the bug (remove the entry then)."""
    found = fuzzed.known.get(bug, []) if bug != "none registered" else [f for fs in fuzzed.known.values() for f in fs]
    assert not found, f"{len(found)} frames; first:\n{found[0]}"


# --- the known suspect, aimed at directly -----------------------------------------------------


@pytest.mark.parametrize("padding", [0, 12])
def test_icmp_error_with_padding_after_the_total_length(hook, table, padding):
    """A backend's port unreachable about a tracked flow, quoting the IP header and 8
    bytes of the client's SYN (the TCP checksum is not quoted), with Ethernet padding
    after the IP total length: translated back to the cluster IP, every checksum valid
    over tot_len, and the padding untouched.

    Failed on a8bd463 (nat.h sought the quoted TCP checksum up to the frame's end): tc,
    SYN 10.0.9.2:40999 -> 10.96.0.10:80 sent to 10.0.2.11, then in
    0200000000020200000000010800450000380000000040015bb90a00020b0a0009020303395d
    00000000450000280000000040065bc40a0009020a00020ba0271f90000003e8000000000000000000000000
    came out with ICMP checksum 0x37bc (valid: 0x589d) and padding bytes 8-9 0000 -> 20e1."""
    client, sport = fuzz.ip("10.0.9.2"), 40999 if hook.name == "tc" else 40998
    verdict, out = hook.run(fuzz.packet(client, fuzz.CIP, fuzz.TCP, fuzz.tcp(sport, 80, 0x02)))
    assert fuzz.VERDICTS[hook.name].get(verdict & 0xFFFFFFFF) == "pass"
    backend = out[30:34]
    assert backend in fuzz.BACKENDS
    syn_at_backend = fuzz.packet(client, backend, fuzz.TCP, fuzz.tcp(sport, 8080, 0x02))[14:]
    err = fuzz.packet(backend, client, fuzz.ICMP, fuzz.icmp(3, 3, bytes(syn_at_backend[:28])))
    frame = bytes(err) + bytes(padding)
    verdict, out = hook.run(frame)
    p = Ether(out)
    assert (p[IP].src, p[IPerror].dst, p[IPerror].payload.dport) == ("10.96.0.10", "10.96.0.10", 80), \
        f"not translated: {out.hex()}"
    sums = fuzz.checksums(out, fuzz.parse(out))
    seen = f"in {frame.hex()} out {out.hex()}"
    assert all(sums.values()), f"checksums {sums}: {seen}"
    assert out[len(err):] == frame[len(err):], f"padding rewritten: {seen}"
    assert_checksums(out)
