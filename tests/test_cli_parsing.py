"""What the `kxlb` command line accepts: every bad input is one line `kxlb: error: ...` on
stderr and exit status 1, found while parsing (before any map is opened); `--version`.

These run the CLI in-process (kxlb.cli.main) and need no datapath: the pin directory is
one that does not exist, so an input wrongly accepted fails with "no datapath pinned"
rather than touching a real datapath."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

import kxlb
from kxlb.cli import check_pin_dir, main
from kxlb.loader.errors import KxlbError

VIP = "10.96.0.10"
ABSENT_PIN_DIR = "/sys/fs/bpf/kxlb-test-absent"


@pytest.fixture(autouse=True)
def absent_pin_dir(monkeypatch):
    monkeypatch.setenv("KXLB_PIN_DIR", ABSENT_PIN_DIR)


def run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """main(argv) -> (exit status, stdout, stderr lines)."""
    try:
        status = main(list(argv))
    except SystemExit as exc:   # --help and --version exit from argparse
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


def refused(capsys, argv, line: str) -> None:
    status, out, err = run(capsys, *argv)
    assert (status, out, err) == (1, "", [f"kxlb: error: {line}"])


# --- argparse's own errors ------------------------------------------------------------------
@pytest.mark.parametrize("argv, line", [
    ([], "the following arguments are required: COMMAND"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus' (choose from 'load', 'unload', 'service', 'cleanup', 'mount-bpffs', 'status', 'downgrade', 'gc', 'list', "
                "'conntrack', 'stats', 'version', 'controller', 'demo', 'lab')"),
    (["--bogus", "list"], "unrecognized arguments: --bogus"),
    (["stats", "a\nb"], "unrecognized arguments: a\\nb"),            # still one line
    (["load"], "load: the following arguments are required: --iface"),
    (["load", "--iface"], "load: argument --iface: expected one argument"),
    (["load", "--iface", "lo", "--xdp-mode", "x"],
     "load: argument --xdp-mode: invalid choice: 'x' (choose from 'generic', 'native')"),
    (["service"], "service: the following arguments are required: ACTION"),
    (["service", "add"], "service add: the following arguments are required: VIP:PORT/PROTO"),
    # sub-commands registered by other packages (_extensions) behave the same
    (["controller", "--min-sync-period", "x"], "controller: argument --min-sync-period: invalid float value: 'x'"),
    (["lab", "up", "--proxy"], "lab up: argument --proxy: expected one argument"),
])
def test_argparse_errors_are_one_line_and_status_1(capsys, argv, line):
    refused(capsys, argv, line)


def test_exit_status_of_the_process():
    """The statuses a script sees: 1 for bad input, 0 for --help (help still printed)."""
    def kxlb_(*args):
        return subprocess.run([sys.executable, "-m", "kxlb", *args], capture_output=True, text=True)
    r = kxlb_("--bogus", "list")
    assert (r.returncode, r.stderr) == (1, "kxlb: error: unrecognized arguments: --bogus\n")
    r = kxlb_("service", "add", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: kxlb service add") and r.stderr == ""


# --- ports ----------------------------------------------------------------------------------
@pytest.mark.parametrize("port", ["8_0", "+81", " 81", "81 ", "0x51", "٨٠", "８０", "8.0", ""])
def test_ports_are_ascii_decimal_digits(capsys, port):
    refused(capsys, ["service", "add", f"{VIP}:{port}/tcp"],
            f"service '{VIP}:{port}/tcp': port {port!r} is not a decimal number")


@pytest.mark.parametrize("argv, line", [
    (["service", "add", f"{VIP}:80/tcp", "10.1.0.1:+81"], "backend '10.1.0.1:+81': port '+81' is not a decimal number"),
    (["service", "add", f"{VIP}:80/tcp", "--node-port", "10.0.0.1:1_0"],
     "--node-port '10.0.0.1:1_0': port '1_0' is not a decimal number"),
    (["service", "add", f"{VIP}:80/tcp", "--local", "10.1.0.1:٨٠"], "--local '10.1.0.1:٨٠': port '٨٠' is not a decimal number"),
    (["service", "add", f"{VIP}:{'9' * 5000}/tcp"], f"service '{VIP}:{'9' * 5000}/tcp': port {'9' * 5000} is out of range 1-65535"),
    (["service", "add", f"{VIP}:80/tcp", "--affinity", "+5"], "--affinity '+5' is not a decimal number"),
    (["service", "add", f"{VIP}:80/tcp", "--affinity", "86401"], "--affinity 86401 is out of range 0-86400"),
])
def test_numbers_of_backends_and_options(capsys, argv, line):
    refused(capsys, argv, line)


# --- addresses ------------------------------------------------------------------------------
NOT_USABLE = "not usable as a service or backend address"


@pytest.mark.parametrize("vip, why", [
    ("0.0.0.0", "the unspecified address"),
    ("[::]", "the unspecified address"),
    ("255.255.255.255", "the broadcast address"),
    ("127.0.0.1", "loopback (127.0.0.0/8)"),
    ("127.1.2.3", "loopback (127.0.0.0/8)"),
    ("[::1]", "loopback (::1)"),
    ("169.254.169.254", "link-local (169.254.0.0/16)"),
    ("[fe80::1]", "link-local (fe80::/10)"),
    ("224.0.0.1", "multicast (224.0.0.0/4)"),
    ("239.1.2.3", "multicast (224.0.0.0/4)"),
    ("[ff02::1]", "multicast (ff00::/8)"),
    ("[ff0e::1]", "multicast (ff00::/8)"),
])
def test_special_service_addresses_are_refused(capsys, vip, why):
    refused(capsys, ["service", "add", f"{vip}:80/tcp"], f"service '{vip}:80/tcp': {vip.strip('[]')!r} is {why}: {NOT_USABLE}")


@pytest.mark.parametrize("argv, line", [
    (["service", "add", f"{VIP}:80/tcp", "0.0.0.0:80"], f"backend '0.0.0.0:80': '0.0.0.0' is the unspecified address: {NOT_USABLE}"),
    (["service", "add", f"{VIP}:80/tcp", "127.0.0.1:80"], f"backend '127.0.0.1:80': '127.0.0.1' is loopback (127.0.0.0/8): {NOT_USABLE}"),
    (["service", "add", "[fd00::10]:80/tcp", "[fe80::2]:80"], f"backend '[fe80::2]:80': 'fe80::2' is link-local (fe80::/10): {NOT_USABLE}"),
    (["service", "add", f"{VIP}:80/tcp", "224.0.0.5:80"], f"backend '224.0.0.5:80': '224.0.0.5' is multicast (224.0.0.0/4): {NOT_USABLE}"),
    (["service", "add", f"{VIP}:80/tcp", "--local", "169.254.0.1:80"],
     f"--local '169.254.0.1:80': '169.254.0.1' is link-local (169.254.0.0/16): {NOT_USABLE}"),
    (["service", "add", f"{VIP}:80/tcp", "--node-port", "127.0.0.1:30080"],
     f"--node-port '127.0.0.1:30080': '127.0.0.1' is loopback (127.0.0.0/8): {NOT_USABLE}"),
    (["service", "add", f"{VIP}:80/tcp", "--external-ip", "0.0.0.0"], f"--external-ip: '0.0.0.0' is the unspecified address: {NOT_USABLE}"),
    (["service", "add", "[fd00::10]:80/tcp", "--load-balancer-ip", "ff02::1"],
     f"--load-balancer-ip: 'ff02::1' is multicast (ff00::/8): {NOT_USABLE}"),
])
def test_special_backend_and_frontend_addresses_are_refused(capsys, argv, line):
    refused(capsys, argv, line)


ZONE = "has an IPv6 zone index (%eth0): give the address without it"


@pytest.mark.parametrize("argv, line", [
    (["service", "add", "[fe80::1%eth0]:80/tcp"], f"service '[fe80::1%eth0]:80/tcp': 'fe80::1%eth0' {ZONE}"),
    (["service", "add", "[fd00::1%eth0]:80/tcp"], f"service '[fd00::1%eth0]:80/tcp': 'fd00::1%eth0' {ZONE}"),
    (["service", "add", "[fd00::10]:80/tcp", "[fd00::1%eth0]:80"], f"backend '[fd00::1%eth0]:80': 'fd00::1%eth0' {ZONE}"),
    (["service", "add", "[fd00::10]:80/tcp", "--external-ip", "fd00::1%eth0"], f"--external-ip: 'fd00::1%eth0' {ZONE}"),
])
def test_ipv6_zone_index_is_one_clear_line(capsys, argv, line):
    refused(capsys, argv, line)


LEADING_ZERO = "has an IPv4 octet with a leading zero, which some parsers read as octal: write it without"


@pytest.mark.parametrize("argv, line", [
    (["service", "add", "010.1.1.1:80/tcp"], f"service '010.1.1.1:80/tcp': '010.1.1.1' {LEADING_ZERO}"),
    (["service", "add", f"{VIP}:80/tcp", "10.1.0.01:80"], f"backend '10.1.0.01:80': '10.1.0.01' {LEADING_ZERO}"),
])
def test_ipv4_leading_zeros_are_refused_with_the_reason(capsys, argv, line):
    refused(capsys, argv, line)


# --- --pin-dir ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, line", [
    (["--pin-dir", "sys/fs/bpf/kxlb", "list"], "--pin-dir 'sys/fs/bpf/kxlb': must be an absolute path"),
    (["--pin-dir", '/sys/fs/bpf/a"b', "list"], "--pin-dir '/sys/fs/bpf/a\"b': '\"' not allowed (letters, digits and /._-@+: only)"),
    (["--pin-dir", "/sys/fs/bpf/a\nb\\", "list"],
     "--pin-dir '/sys/fs/bpf/a\\nb\\\\': '\\n', '\\\\' not allowed (letters, digits and /._-@+: only)"),
    (["--pin-dir", "/sys/fs/bpf/../kxlb", "list"], "--pin-dir '/sys/fs/bpf/../kxlb': must not contain '..'"),
    (["list", "--pin-dir", "/sys/fs/bpf/a b"], "--pin-dir '/sys/fs/bpf/a b': ' ' not allowed (letters, digits and /._-@+: only)"),
])
def test_pin_dir_is_checked_before_it_reaches_the_c_source(capsys, argv, line):
    refused(capsys, argv, line)


def test_pin_dir_from_the_environment_is_checked_too(capsys, monkeypatch):
    monkeypatch.setenv("KXLB_PIN_DIR", "/sys/fs/bpf/$x")
    refused(capsys, ["list"], "--pin-dir '/sys/fs/bpf/$x': '$' not allowed (letters, digits and /._-@+: only)")


def test_check_pin_dir_keeps_usable_paths():
    for path in ("/sys/fs/bpf/kxlb", "/sys/fs/bpf/kx/node-1.example.com", "/sys/fs/bpf/a_b+c@d:e/..x"):
        assert check_pin_dir(path) == path
    with pytest.raises(KxlbError, match=r"^pin directory 'x': must be an absolute path$"):
        check_pin_dir("x", what="pin directory")


# --- version --------------------------------------------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """kxlb run from a (fake) checkout at tmp_path, with mapspec's LAYOUT_VERSION 7."""
    monkeypatch.setattr(kxlb, "_ROOT", tmp_path)
    monkeypatch.setitem(sys.modules, "kxlb.loader.mapspec", types.SimpleNamespace(LAYOUT_VERSION=7))
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return tmp_path


def test_version_option_and_command(capsys, checkout):
    (checkout / ".git" / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    text = f"kxlb {kxlb.version()}\ncommit {COMMIT}\ndatapath layout 7\n"
    assert run(capsys, "--version") == (0, text, [])
    assert run(capsys, "version") == (0, text, [])
    status, out, err = run(capsys, "version", "--json")
    assert (status, json.loads(out), err) == (0, {"version": kxlb.version(), "commit": COMMIT, "layout_version": 7}, [])


def test_version_reads_packed_refs_and_a_detached_head(capsys, checkout):
    (checkout / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{'f' * 40} refs/heads/other\n"
                                                   f"{COMMIT} refs/heads/main\n")
    assert json.loads(run(capsys, "version", "--json")[1])["commit"] == COMMIT
    (checkout / ".git" / "HEAD").write_text("e" * 40 + "\n")
    assert json.loads(run(capsys, "version", "--json")[1])["commit"] == "e" * 40


def test_version_in_an_installed_image(capsys, tmp_path, monkeypatch):
    """No .git, no pyproject.toml beside the package, no mapspec: the version from the
    package metadata, the commit said unknown, no layout line."""
    monkeypatch.setattr(kxlb, "_ROOT", tmp_path)
    monkeypatch.setitem(sys.modules, "kxlb.loader.mapspec", None)   # importing it fails as if absent
    assert run(capsys, "version") == (0, f"kxlb {kxlb.version()}\ncommit unknown (not run from a git checkout)\n", [])


def test_version_of_a_checkout_never_installed(capsys, checkout, monkeypatch):
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", not_installed)
    (checkout / "pyproject.toml").write_text('[project]\nname = "kxlb"\nversion = "9.8.7"\n')
    assert run(capsys, "--version")[1].splitlines()[0] == "kxlb 9.8.7"
