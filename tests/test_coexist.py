"""Good neighbour (issue 8, item 6) and XDP only where it is correct (item 4), with real
interfaces, tc filters, XDP programs and traffic in network namespaces:

- traffic that is not ours reaches the next tc filter (TC_ACT_UNSPEC);
- an XDP program kxlb did not attach is never replaced or detached without --force;
- a failed generic -> native switch leaves the generic program attached;
- the pin directory is created 0700, refused when someone else could write to it, and
  unload removes only the pins kxlb recorded;
- XDP on a veth is refused, and the failure it prevents is shown: with TX checksum
  offload off on the next hop, translated packets arrive with bad checksums.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from kxlb.lab.client import tcp_request
from kxlb.lab.netlab import unique_tag
from kxlb.loader import attach, datapath
from kxlb.loader.errors import KxlbError
from kxlb.loader.mapspec import build_pins
from kxlb.loader.netns import netns
from harness import add_tc_filter

VIP, PORT, BPORT = "10.96.0.10", 80, 8080


def kxlb(pin_dir, *args):
    return subprocess.run([sys.executable, "-m", "kxlb", "--pin-dir", pin_dir, *args],
                          capture_output=True, text=True)


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def sh(*args, check=True):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check:
        assert r.returncode == 0, f"{' '.join(args)}: {r.stderr}"
    return r


def one_line_error(r, *needles):
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kxlb: error:"), r.stderr
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


# --- a foreign XDP program -----------------------------------------------------------------
@pytest.fixture(scope="module")
def foreign_xdp():
    """Another tool's XDP program (passes everything), loaded with BCC."""
    from bcc import BPF

    b = BPF(text=b"int foreign_xdp(struct xdp_md *ctx) { return XDP_PASS; }")
    fn = b.load_func(b"foreign_xdp", BPF.XDP)
    yield fn.fd, attach.prog_ref(fn.fd)
    b.cleanup()


def set_xdp(ns, iface, fd, mode="generic"):
    """Attach (fd >= 0) or detach at XDP with plain netlink, as another tool would."""
    from pyroute2 import IPRoute

    with netns(ns):
        ipr = IPRoute()
    try:
        idx = ipr.link_lookup(ifname=iface)[0]
        ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", attach.XDP_FLAGS[mode])]})
    finally:
        ipr.close()


def test_tc_load_leaves_a_foreign_xdp_program_attached(netlab, foreign_xdp):
    fd, ref = foreign_xdp
    set_xdp(netlab.node, netlab.client_iface, fd)
    ok(kxlb(netlab.pin_dir, "load", "--netns", netlab.node, "--iface", netlab.client_iface))
    assert attach.tc_attached(netlab.node, netlab.client_iface)
    assert attach.xdp_programs(netlab.node, netlab.client_iface) == {"generic": ref.id}
    ok(kxlb(netlab.pin_dir, "unload"))
    assert attach.xdp_programs(netlab.node, netlab.client_iface) == {"generic": ref.id}


def test_xdp_load_refuses_to_replace_a_foreign_program_unless_forced(netlab, foreign_xdp):
    fd, ref = foreign_xdp
    set_xdp(netlab.node, netlab.client_iface, fd)
    args = ["load", "--netns", netlab.node, "--iface", netlab.client_iface, "--xdp", "--xdp-trust-checksums"]
    one_line_error(kxlb(netlab.pin_dir, *args), "XDP program kxlb did not attach", "foreign_xdp",
                   f"id {ref.id}", "--force")
    assert attach.xdp_programs(netlab.node, netlab.client_iface) == {"generic": ref.id}
    assert not attach.tc_attached(netlab.node, netlab.client_iface)
    # In the other mode too: native would have to detach it first.
    one_line_error(kxlb(netlab.pin_dir, *args, "--xdp-mode", "native"), "foreign_xdp")
    assert attach.xdp_programs(netlab.node, netlab.client_iface) == {"generic": ref.id}
    ok(kxlb(netlab.pin_dir, *args, "--force"))
    now = attach.xdp_programs(netlab.node, netlab.client_iface)
    assert list(now) == ["generic"] and attach.prog_ref_by_id(now["generic"]).name == "kxlb_xdp"
    ok(kxlb(netlab.pin_dir, "unload"))


def test_unload_detaches_only_the_xdp_program_kxlb_attached(netlab, foreign_xdp):
    fd, ref = foreign_xdp
    pin, node = netlab.pin_dir, netlab.node
    for iface in ("be0", "be1"):
        ok(kxlb(pin, "load", "--netns", node, "--iface", iface, "--xdp", "--xdp-trust-checksums"))
    set_xdp(node, "be0", fd)  # another tool takes be0 over after us
    r = ok(kxlb(pin, "unload", "--netns", node, "--iface", "be0"))
    assert "not the one kxlb attached" in r.stdout and "foreign_xdp" in r.stdout
    assert attach.xdp_programs(node, "be0") == {"generic": ref.id}
    r = ok(kxlb(pin, "unload"))
    assert attach.xdp_programs(node, "be0") == {"generic": ref.id}
    assert attach.xdp_programs(node, "be1") == {}  # ours: gone


def test_a_failed_switch_to_native_keeps_the_generic_program(netlab):
    """An ifb device has no native XDP: the switch fails and the interface keeps the
    program it had, which is still recorded as ours (unload removes it)."""
    pin, node = netlab.pin_dir, netlab.node
    sh("ip", "-n", node, "link", "add", "ifb0", "type", "ifb")
    sh("ip", "-n", node, "link", "set", "ifb0", "up")
    base = ["load", "--netns", node, "--iface", "ifb0", "--xdp", "--xdp-trust-checksums"]
    ok(kxlb(pin, *base))
    before = attach.xdp_programs(node, "ifb0")
    assert list(before) == ["generic"]
    one_line_error(kxlb(pin, *base, "--xdp-mode", "native"), "ifb0", "attached again")
    assert attach.xdp_programs(node, "ifb0") == before
    ok(kxlb(pin, "unload"))
    assert attach.xdp_programs(node, "ifb0") == {}


# --- the next tc filter ---------------------------------------------------------------------
OTHER_TOOL = b"""
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
BPF_ARRAY(seen, u64, 1);
int other_tool(struct __sk_buff *skb)
{
	int k = 0;
	u64 *n = seen.lookup(&k);

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return TC_ACT_UNSPEC;
	if (n)
		__sync_fetch_and_add(n, 1);
	return TC_ACT_SHOT;   /* this tool's policy: no IPv4 in on this interface */
}
"""


@pytest.fixture
def other_tool():
    """Another tool's tc program: counts IPv4 packets and drops them."""
    from bcc import BPF

    b = BPF(text=OTHER_TOOL)
    fn = b.load_func(b"other_tool", BPF.SCHED_CLS)
    yield fn.fd, lambda: b[b"seen"][0].value
    b.cleanup()


def test_traffic_that_is_not_ours_reaches_the_next_tc_filter(netlab, other_tool):
    """Another tool's filter after ours (a later priority) drops IPv4 on the client's
    interface. Datagrams to the node are not ours: they must reach that filter (and be
    dropped by it); service traffic, translated by us, is delivered (TC_ACT_OK ends
    classification at our filter)."""
    fd, seen = other_tool
    pin, node = netlab.pin_dir, netlab.node
    netlab.start_servers(BPORT)
    ok(kxlb(pin, "load", "--netns", node, *[a for i in netlab.node_ifaces for a in ("--iface", i)]))
    ok(kxlb(pin, "service", "add", f"{VIP}:{PORT}/tcp", f"{netlab.backend_ip(0)}:{BPORT}"))
    with netns(node):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with netns(netlab.client):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind((netlab.node_client_ip, 7777))
        rx.settimeout(1.0)
        tx.sendto(b"before", (netlab.node_client_ip, 7777))
        assert rx.recv(100) == b"before"  # the path works: kxlb passes it on
        add_tc_filter(node, netlab.client_iface, fd, attach.TC_PRIO + 1)
        for n in range(3):
            tx.sendto(b"after %d" % n, (netlab.node_client_ip, 7777))
        with pytest.raises(TimeoutError):
            rx.recv(100)  # dropped by the other tool's filter, which saw them
    assert seen() == 3
    reply, peer = tcp_request(netlab.client, VIP, PORT, "through")
    assert peer == (VIP, PORT) and reply == "be0 through"
    assert seen() == 3  # translated packets end at our filter
    ok(kxlb(pin, "unload"))  # the other tool's filter (and the clsact it sits on) stay
    out = sh("tc", "-n", node, "filter", "show", "dev", netlab.client_iface, "ingress").stdout
    assert "other_tool" in out and "kxlb_tc" not in out


# --- the pin directory -----------------------------------------------------------------------
def test_a_foreign_tc_filter_at_kxlbs_priority_and_handle_is_neither_replaced_nor_deleted(netlab, other_tool):
    """Another tool's filter sits where kxlb's goes (same priority, same handle): `kxlb
    load` refuses with one line naming it and changes nothing; `kxlb unload` leaves it; and
    kxlb's own filter there is replaced (a re-load), as before."""
    fd, _ = other_tool
    pin, node = netlab.pin_dir, netlab.node
    iface = netlab.client_iface
    sh("tc", "-n", node, "qdisc", "add", "dev", iface, "clsact")
    add_tc_filter(node, iface, fd, attach.TC_PRIO)
    line = one_line_error(kxlb(pin, "load", "--netns", node, "--iface", iface), iface, "another tool's",
                          "'other_tool'", "does not replace it")
    assert "tc filter del" in line
    show = lambda: sh("tc", "-n", node, "filter", "show", "dev", iface, "ingress").stdout  # noqa: E731
    assert "other_tool" in show() and "kxlb_tc" not in show()
    attach.detach_tc(node, iface)                    # what unload and the cleanup call
    assert "other_tool" in show()
    sh("tc", "-n", node, "filter", "del", "dev", iface, "ingress", "pref", str(attach.TC_PRIO))
    ok(kxlb(pin, "load", "--netns", node, "--iface", iface))
    ok(kxlb(pin, "load", "--netns", node, "--iface", iface))   # its own filter: replaced, not refused
    assert sum(1 for line in show().splitlines() if "handle" in line and "kxlb_tc" in line) == 1
    ok(kxlb(pin, "unload"))
    assert "kxlb_tc" not in show()


def test_the_pin_directory_is_made_0700_and_unload_removes_only_what_kxlb_pinned(netlab):
    pin, node = netlab.pin_dir, netlab.node
    ok(kxlb(pin, "load", "--netns", node, "--iface", netlab.client_iface))
    assert oct(os.stat(pin).st_mode & 0o7777) == "0o700"
    assert build_pins() <= set(os.listdir(pin))
    sh("bpftool", "map", "create", f"{pin}/other_tool", "type", "array", "key", "4", "value", "4", "entries", "1",
       "name", "other_tool")
    r = ok(kxlb(pin, "unload"))
    assert "kept" in r.stdout and "other_tool" in r.stdout
    assert os.listdir(pin) == ["other_tool"]
    os.unlink(f"{pin}/other_tool")
    os.rmdir(pin)


def test_a_wrong_pin_dir_removes_nothing(netlab):
    """Another tool's directory, even with a pin named like one of ours: unload with it as
    --pin-dir finds no record of kxlb there and leaves everything."""
    other = netlab.pin_dir + "-other"
    os.mkdir(other, 0o700)
    try:
        for name in ("services", "their_map"):
            sh("bpftool", "map", "create", f"{other}/{name}", "type", "array", "key", "4", "value", "4",
               "entries", "1", "name", name)
        ok(kxlb(other, "unload"))
        assert sorted(os.listdir(other)) == ["services", "their_map"]
    finally:
        for f in os.listdir(other):
            os.unlink(os.path.join(other, f))
        os.rmdir(other)


@pytest.mark.parametrize("owner, mode, message", [
    (12345, 0o700, "owned by uid 12345, not root"),
    (0, 0o777, "mode 0777 (group- or world-writable)"),
    (0, 0o720, "mode 0720"),
])
def test_a_pin_directory_others_can_write_to_is_refused(netlab, owner, mode, message):
    pin = netlab.pin_dir
    os.mkdir(pin)
    os.chown(pin, owner, 0)
    os.chmod(pin, mode)
    r = kxlb(pin, "load", "--netns", netlab.node, "--iface", netlab.client_iface)
    one_line_error(r, f"pin directory {pin}", message)
    assert os.listdir(pin) == []  # nothing compiled, pinned or adopted there
    assert not attach.tc_attached(netlab.node, netlab.client_iface)


@pytest.mark.parametrize("shape, message", [
    ("parent owned by another user", "owned by uid 12345, not root"),
    ("parent world-writable, not sticky", "mode 0777 (group- or world-writable, not sticky)"),
    ("symbolic link owned by another user", "symbolic link owned by uid 12345"),
])
def test_a_pin_directory_below_one_others_can_replace_is_refused(shape, message):
    """Whoever may rename a directory above the pin directory can swap the pin directory
    itself for their own: each one above must be root's and not writable by others unless
    sticky, and a symbolic link on the way root's. Nothing is made below it."""
    top = f"/sys/fs/bpf/{unique_tag()}"
    os.mkdir(top, 0o700)
    try:
        pin = f"{top}/parent/kxlb"
        if shape == "symbolic link owned by another user":
            os.mkdir(f"{top}/real", 0o700)
            os.symlink(f"{top}/real", f"{top}/parent")
            os.lchown(f"{top}/parent", 12345, 12345)
        else:
            os.mkdir(f"{top}/parent")
            os.chown(f"{top}/parent", 12345 if "another user" in shape else 0, 0)
            os.chmod(f"{top}/parent", 0o777 if "world-writable" in shape else 0o755)
        with pytest.raises(KxlbError, match=re.escape(message)) as err:
            datapath.prepare_pin_dir(pin)
        assert f"pin directory {pin}" in str(err.value) and "\n" not in str(err.value)
        assert not os.path.lexists(pin)
        os.chown(f"{top}/parent", 0, 0, follow_symlinks=False)   # root's, 0755: accepted
        if os.path.isdir(f"{top}/parent") and not os.path.islink(f"{top}/parent"):
            os.chmod(f"{top}/parent", 0o1777 if "world-writable" in shape else 0o755)  # sticky: accepted
        datapath.prepare_pin_dir(pin)
        assert stat.S_IMODE(os.stat(pin).st_mode) == 0o700
    finally:
        shutil.rmtree(top, ignore_errors=True)


# --- XDP only where it is correct ------------------------------------------------------------
def test_xdp_on_virtual_devices_is_refused_with_the_reason(netlab):
    node = netlab.node
    sh("ip", "-n", node, "link", "add", "br9", "type", "bridge")
    sh("ip", "-n", node, "link", "add", "ifb9", "type", "ifb")
    for iface, kind in ((netlab.client_iface, "veth"), ("br9", "bridge"), ("ifb9", "ifb"), ("lo", "loopback")):
        r = kxlb(netlab.pin_dir, "load", "--netns", node, "--iface", iface, "--xdp")
        one_line_error(r, f"--xdp on {iface} refused", kind, "CHECKSUM_PARTIAL", "--xdp-trust-checksums")
        assert attach.xdp_programs(node, iface) == {}


def nstat(ns, counter):
    out = sh("ip", "netns", "exec", ns, "nstat", "-saz", counter).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.startswith(counter))


def tx_checksum_offload(ns, iface, on):
    sh("ip", "netns", "exec", ns, "ethtool", "-K", iface, "tx", "on" if on else "off")


def through_vip(netlab, hook_args, finalising_senders):
    """Load with ``hook_args``, turn TX checksum offload off on the node's interfaces to
    the backends (the next hop finalises checksums in software), optionally on every
    sender too; then one TCP request through the VIP. Returns (reply or the error,
    TcpInCsumErrors counted by the backends)."""
    netlab.start_servers(BPORT)
    ok(kxlb(netlab.pin_dir, "load", "--netns", netlab.node, *hook_args,
            *[a for i in netlab.node_ifaces for a in ("--iface", i)]))
    backends = [f"{netlab.backend_ip(i)}:{BPORT}" for i in range(netlab.backends_n)]
    ok(kxlb(netlab.pin_dir, "service", "add", f"{VIP}:{PORT}/tcp", *backends))
    for i in range(netlab.backends_n):
        tx_checksum_offload(netlab.node, netlab.backend_iface(i), False)
        if finalising_senders:
            tx_checksum_offload(netlab.backend(i), "eth0", False)
    if finalising_senders:
        tx_checksum_offload(netlab.client, "eth0", False)
    errors = lambda: sum(nstat(netlab.backend(i), "TcpInCsumErrors") for i in range(netlab.backends_n))  # noqa: E731
    before = errors()
    try:
        result = tcp_request(netlab.client, VIP, PORT, "csum", timeout=2.0)
    except OSError as exc:
        result = exc
    return result, errors() - before


def test_xdp_on_a_veth_breaks_partial_checksums_which_is_why_it_is_refused(netlab):
    """The failure the refusal prevents: the client's socket leaves the checksum to its
    veth (CHECKSUM_PARTIAL), XDP adjusts the pseudo-header seed as if it were a full
    checksum, the node's next hop (TX offload off) finalises it: the backend drops the
    SYN as corrupt and the connection times out."""
    result, csum_errors = through_vip(netlab, ["--xdp", "--xdp-trust-checksums"], finalising_senders=False)
    assert isinstance(result, TimeoutError), result
    assert csum_errors >= 1


def test_tc_on_the_same_veths_is_correct(netlab):
    result, csum_errors = through_vip(netlab, [], finalising_senders=False)
    assert not isinstance(result, Exception), result
    assert result[0].endswith(" csum") and result[1] == (VIP, PORT)
    assert csum_errors == 0


def test_xdp_is_correct_when_every_sender_finalises_its_checksums(netlab):
    """What --xdp-trust-checksums states: with the senders' TX checksum offload off (as
    frames from a wire always are), XDP's incremental update is right."""
    result, csum_errors = through_vip(netlab, ["--xdp", "--xdp-trust-checksums"], finalising_senders=True)
    assert not isinstance(result, Exception), result
    assert result[0].endswith(" csum") and result[1] == (VIP, PORT)
    assert csum_errors == 0
