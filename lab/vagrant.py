"""The Vagrant lab VM: a Debian 12 box built here, its network, and the datapath tests inside it.

``python -m kxlb.lab.vagrant box``   builds the box (``make vagrant-box``), cached by its inputs
``python -m kxlb.lab.vagrant test``  box, ``vagrant up``, the datapath tests in the VM, destroy
``python -m kxlb.lab.vagrant up|down`` the VM (and its network) for working in it by hand

**The box** is what a fresh minimal Debian 12 becomes with the project's own set-up:
mmdebstrap's ``minbase`` (no make, no sudo, no Python) plus a kernel, systemd, ssh, GRUB and
the guest agent, then ``scripts/setup.sh``'s package step run in it as on any new machine
(``KXLB_SETUP_ONLY=packages``). So the VM needs nothing from outside to run the datapath
tests, and the set-up's package list is proved on a minimal Debian each time it changes. The
disk is written without a mount: ``mke2fs -d`` fills the partition, then one short boot of
it in QEMU, with the kernel given directly and a script as init, installs the box's own GRUB. Cached in ``$KXLB_CACHE/vagrant`` (default
/var/cache/kxlb) by a digest of the recipe, the set-up script, the Debian sources and the
month (security updates reach a box built next month).

**The network** changes nothing on the host's firewall or forwarding: vagrant-libvirt's
management network is a NAT network (firewall rules, ``ip_forward=1``), so it is off
(``mgmt_attach = false``); the VM has one NIC on a bridge of ours with a dnsmasq of ours
that hands out addresses only (no router, no DNS), declared to libvirt as a network in
bridge mode (libvirt adds no rules for those), and the VM's address comes from the guest
agent. Packages and the Go toolchain reach the VM through a second NIC in QEMU's user-mode
network, a NAT inside the QEMU process. Nothing here is bridged to the host's uplink.

**No systemd on the host**: virtlogd and libvirtd are started here when they are not
running, and stopped at the end if they were started here.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .imagebuild import CA_BUNDLE, DEBIAN_SOURCES, DEBIAN_SUITE

REPO = Path(__file__).resolve().parent.parent
VAGRANT_DIR = REPO / "vagrant"
CUSTOMIZE = VAGRANT_DIR / "box-customize.sh"
SETUP = REPO / "scripts" / "setup.sh"

BOX_NAME = "kxlb/debian12"          # vagrant/Vagrantfile's config.vm.box for libvirt
# The minimal Debian and what any Vagrant box has: a kernel, init, ssh for vagrant, sudo for
# its user, rsync for the synced folder, GRUB to boot, the guest agent for the VM's address
# (mgmt_attach off), networkd and resolved for DHCP on both NICs. The kernel is
# bookworm-backports' 6.12 LTS, with its headers for BCC: bookworm's own 6.1 loads kxlb's
# programs now, but the packet suites have not run on it (docs/vagrant.md).
BOX_PACKAGES = ("linux-image-amd64/bookworm-backports", "linux-headers-amd64/bookworm-backports", "systemd-sysv", "udev", "dbus", "openssh-server", "sudo", "rsync",
                "iproute2", "iputils-ping", "procps", "grub-pc", "initramfs-tools", "e2fsprogs", "kmod",
                "qemu-guest-agent", "systemd-resolved", "ca-certificates", "less")
BOX_SOURCES = (*DEBIAN_SOURCES, f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-backports main")
DISK_GB = 12
BOX_RECIPE = 2                      # bump when the steps below (disk, GRUB, packaging) change
PART_OFFSET = 1 << 20               # the partition starts at 1 MiB (LBA 2048), GRUB's core in the gap

# The VM's network on the host: names and the address range (a private /24 nothing else uses).
NETWORK = "kxlb-vagrant"            # the libvirt network the Vagrantfile names
BRIDGE = "kxlbvbr0"
HOST_CIDR = "192.168.213.1/24"
DHCP_RANGE = ("192.168.213.10", "192.168.213.99")
POOL = "default"                    # vagrant-libvirt's storage pool
POOL_DIR = Path("/var/lib/libvirt/images")

# What runs in the VM: the PROG_TEST_RUN suite, the packet-injection and real-traffic cases
# of the netns suite on both hooks and both families, and the standalone demo. Each netns
# case compiles the datapath (about 2 minutes under TCG), so the VM takes those that cover
# the journeys and not every variant the host runs.
NETNS = "tests/test_netns.py::"
VM_TESTS = ("tests/test_prog_run.py",
            "tests/test_prog_run_sctp.py",      # SCTP's CRC update through another kernel's verifier
            "tests/test_prog_run_pmtu.py",      # another kernel's route lookup (mtu_result) for path MTU
            "tests/test_verifier_budget.py",    # another kernel's verifier: how close to its limit
            NETNS + "test_injected_frame_arrives_rewritten_at_the_backend[tc]",
            NETNS + "test_injected_frame_arrives_rewritten_at_the_backend[xdp]",
            NETNS + "test_ipv6_tcp_and_udp_reach_every_backend_and_replies_come_from_the_vip[tc]")
# Left to the host: the writer's race with a reader, timed by flips of a writer process,
# takes 5 minutes a hook under TCG and checks the writer's order, not the kernel's.
VM_DESELECT = ("tests/test_prog_run.py::test_backend_swap_never_exposes_a_half_written_service",)
VM_TEST_TIMEOUT = 1800              # s per test in the VM (pytest-timeout; the suite's is 300)
VM_TESTS_DEADLINE = 4800            # s allowed the VM's whole test run (it takes about 45 min under TCG)
VM_PROJECT = "/kxlb"
VM_NAME = "kxlb-lab"                # the libvirt domain (Vagrantfile: default_prefix "" + define)


class VagrantLabError(Exception):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("KXLB_CACHE", "/var/cache/kxlb")) / "vagrant"


def run(argv: list[str], what: str, *, log: Path | None = None, timeout: float = 1800, check: bool = True,
        env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run *argv*; on failure raise with *what*, the command and its output's tail (or log)."""
    try:
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as f:
                r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=cwd)
            out = log.read_text(errors="replace")
        else:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
            out = (r.stdout or "") + (r.stderr or "")
    except FileNotFoundError:
        raise VagrantLabError(f"{what}: {argv[0]} is not installed (scripts/setup-vagrant.sh installs it)") from None
    except subprocess.TimeoutExpired:
        raise VagrantLabError(f"{what}: {' '.join(argv)} did not finish in {timeout:.0f}s"
                              + (f" (log {log})" if log else "")) from None
    if check and r.returncode != 0:
        where = f" (log {log})" if log else ""
        raise VagrantLabError(f"{what} failed{where}: {' '.join(argv)}\n{out.strip()[-3000:]}")
    r.output = out
    return r


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


# -- the box ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    path: Path       # the .box file
    key: str
    built: bool      # False: found in the cache
    seconds: float


class BoxBuild:
    """The box of one checkout: inputs digested, each step's output cached under its key."""

    def __init__(self, out: Path | None = None, log: Callable[[str], None] = print):
        self.out = out or cache_dir()
        self.log = log

    def month(self) -> str:
        return os.environ.get("KXLB_DEBIAN_DATE") or time.strftime("%Y-%m", time.gmtime())

    def key(self) -> str:
        recipe = json.dumps({"packages": BOX_PACKAGES, "suite": DEBIAN_SUITE, "sources": BOX_SOURCES,
                             "disk": DISK_GB, "month": self.month(), "recipe": BOX_RECIPE},
                            sort_keys=True).encode()
        return _digest(recipe, CUSTOMIZE.read_bytes(), SETUP.read_bytes())

    def rootfs_key(self) -> str:
        recipe = json.dumps({"packages": BOX_PACKAGES, "suite": DEBIAN_SUITE, "sources": BOX_SOURCES,
                             "month": self.month()}, sort_keys=True).encode()
        return _digest(recipe, CUSTOMIZE.read_bytes(), SETUP.read_bytes())

    def box_path(self, key: str | None = None) -> Path:
        return self.out / f"kxlb-debian12-{key or self.key()}.box"

    def ensure(self) -> Box:
        t = time.monotonic()
        key = self.key()
        box = self.box_path(key)
        if box.exists():
            return Box(box, key, False, time.monotonic() - t)
        with _flock(self.out / ".box.lock"):
            if box.exists():
                return Box(box, key, False, time.monotonic() - t)
            # The root file system (the long step) is kept until a box is made from it: a
            # failure in a later step does not run mmdebstrap again.
            work = self.out / f"build-{self.rootfs_key()}"
            rootfs, done = work / "rootfs", work / "rootfs.done"
            if not done.exists():
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                self._rootfs(rootfs, work / "mmdebstrap.log")
                done.touch()
            self._firstboot_script(rootfs)
            self._disk(rootfs, work / "disk.raw")
            self._install_grub(work / "disk.raw", rootfs, work / "firstboot.log")
            self._package(work / "disk.raw", box, work)
            shutil.rmtree(work, ignore_errors=True)
            for old in self.out.glob("kxlb-debian12-*.box"):
                if old != box:
                    old.unlink()
        self.log(f"box {box.name}: built in {time.monotonic() - t:.0f}s ({box.stat().st_size / 2**20:.0f} MiB)")
        return Box(box, key, True, time.monotonic() - t)

    def _rootfs(self, rootfs: Path, log: Path) -> None:
        self.log("box: Debian 12 minbase, then the project's set-up (packages) in it: mmdebstrap")
        argv = ["mmdebstrap", "--mode=root", "--variant=minbase", "--include=" + ",".join(BOX_PACKAGES),
                "--customize-hook=bash " + str(CUSTOMIZE) + ' "$1" ' + str(REPO),
                DEBIAN_SUITE, str(rootfs), *BOX_SOURCES]
        run(argv, "the box's root file system (mmdebstrap)", log=log, timeout=3600)
        # mmdebstrap writes these two at its very end, after the hooks
        (rootfs / "etc/hostname").write_text("kxlb-lab\n")
        resolv = rootfs / "etc/resolv.conf"
        resolv.unlink(missing_ok=True)
        resolv.symlink_to("/run/systemd/resolve/stub-resolv.conf")

    def _disk(self, rootfs: Path, disk: Path) -> None:
        """A raw disk: an MBR with one bootable Linux partition at 1 MiB, ext4 labelled "root"
        filled from *rootfs* (no mount, no loop device)."""
        size = DISK_GB << 30
        with open(disk, "wb") as f:
            f.truncate(size)
        r = subprocess.run(["sfdisk", "--quiet", str(disk)], input=f"start={PART_OFFSET // 512}, type=83, bootable\n",
                           text=True, capture_output=True)
        if r.returncode:
            raise VagrantLabError(f"the box's partition table (sfdisk {disk}): {r.stderr.strip()}")
        blocks_k = (size - PART_OFFSET) // 1024
        run(["mke2fs", "-q", "-t", "ext4", "-L", "root", "-d", str(rootfs), "-E", f"offset={PART_OFFSET}",
             str(disk), f"{blocks_k}k"], "the box's file system (mke2fs -d)", timeout=1800)

    FIRSTBOOT = "/usr/local/sbin/kxlb-box-grub"
    FIRSTBOOT_OK = "kxlb-box: GRUB installed"

    def _firstboot_script(self, rootfs: Path) -> None:
        """The init of the box's one boot on this host: GRUB onto the VM's disk, then off.
        grub-install and update-grub probe the disk's devices, which the image has not got
        here (this kernel makes no partition devices for loop devices); in the VM it is vda."""
        script = rootfs / self.FIRSTBOOT.lstrip("/")
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(
            "#!/bin/bash\n"
            "# Run once as init by lab/vagrant.py while the box is built; removes itself.\n"
            "mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev\n"
            "mount -o remount,rw /\n"
            "if grub-install --target=i386-pc /dev/vda && update-grub; then\n"
            f"  rm -f {self.FIRSTBOOT}; sync; echo '{self.FIRSTBOOT_OK}'\n"
            "fi\n"
            "mount -o remount,ro /; sync\n"
            "echo o > /proc/sysrq-trigger; sleep 60\n")
        script.chmod(0o755)

    def _install_grub(self, disk: Path, rootfs: Path, log: Path) -> None:
        """Boot the disk once, straight into the kernel (QEMU's -kernel), with the first-boot
        script as init: the box's own grub-pc installs GRUB where the VM will find it."""
        kernels = sorted((rootfs / "boot").glob("vmlinuz-*"))
        initrds = sorted((rootfs / "boot").glob("initrd.img-*"))
        if not kernels or not initrds:
            raise VagrantLabError(f"{rootfs}/boot has no kernel or initramfs to boot the box with")
        accel = "kvm" if _has_hardware_virt() else "tcg"
        argv = ["qemu-system-x86_64", "-accel", accel, "-cpu", "max" if accel == "tcg" else "host",
                "-smp", "2", "-m", "1024", "-display", "none", "-monitor", "none", "-no-reboot",
                "-serial", f"file:{log}", "-nic", "none",
                "-drive", f"file={disk},format=raw,if=virtio",
                "-kernel", str(kernels[-1]), "-initrd", str(initrds[-1]),
                "-append", f"root=/dev/vda1 ro console=ttyS0 panic=-1 init={self.FIRSTBOOT}"]
        t = time.monotonic()
        run(argv, "the box's first boot (GRUB)", timeout=900)
        if self.FIRSTBOOT_OK not in log.read_text(errors="replace"):
            raise VagrantLabError(f"the box's first boot did not install GRUB (console log {log}):\n"
                                  f"{log.read_text(errors='replace')[-2000:]}")
        self.log(f"box: GRUB installed in one boot ({accel}, {time.monotonic() - t:.0f}s)")

    def _package(self, disk: Path, box: Path, work: Path) -> None:
        img = work / "box.img"
        run(["qemu-img", "convert", "-c", "-O", "qcow2", str(disk), str(img)], "qcow2 image (qemu-img)",
            timeout=1800)
        (work / "metadata.json").write_text(json.dumps({"provider": "libvirt", "format": "qcow2",
                                                        "virtual_size": DISK_GB}))
        tmp = box.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as tar:
            for name in ("metadata.json", "box.img"):
                tar.add(work / name, arcname=name)
        os.replace(tmp, box)


def _has_hardware_virt() -> bool:
    """vmx/svm: KVM can run a stock kernel. (This machine's /dev/kvm is a software backend,
    kvm_pvm, on which a Debian kernel dies: TCG there.) vagrant/Vagrantfile decides alike."""
    with contextlib.suppress(OSError):
        return bool(re.search(r"^flags\s*:.*\b(vmx|svm)\b", Path("/proc/cpuinfo").read_text(), re.M))
    return False


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# -- vagrant's view of the box -----------------------------------------------------------------

def vagrant_env() -> dict:
    env = {**os.environ, "VAGRANT_DEFAULT_PROVIDER": "libvirt", "VAGRANT_CHECKPOINT_DISABLE": "1"}
    if CA_BUNDLE.exists():   # the set-up in the VM trusts what this host trusts (Vagrantfile)
        env.setdefault("KXLB_VAGRANT_CA_BUNDLE", str(CA_BUNDLE))
    return env


def box_added(box: Box) -> bool:
    """Whether vagrant holds *box* (the key is kept beside vagrant's copy of it)."""
    return _added_key_file().exists() and _added_key_file().read_text().strip() == box.key


def _added_key_file() -> Path:
    return cache_dir() / "box-added.key"


def add_box(box: Box, virsh: Callable[..., subprocess.CompletedProcess]) -> None:
    """``vagrant box add`` *box*, replacing an older build: vagrant-libvirt keeps its own copy
    of a box's image in the storage pool and would go on using the old one."""
    if box_added(box):
        return
    run(["vagrant", "box", "add", "--force", "--name", BOX_NAME, str(box.path)], "vagrant box add",
        env=vagrant_env(), timeout=1800)
    prefix = BOX_NAME.replace("/", "-VAGRANTSLASH-") + "_vagrant_box_image"
    vols = virsh("vol-list", "--pool", POOL, check=False).stdout
    for vol in re.findall(r"^\s*(\S+)\s", vols, re.M):
        if vol.startswith(prefix):
            virsh("vol-delete", "--pool", POOL, vol)
    _added_key_file().write_text(box.key + "\n")


# -- the host side: libvirt, the bridge, dnsmasq ---------------------------------------------------

@dataclass
class HostState:
    """What the host's network looked like before: checked again after teardown."""
    ip_forward: str
    ip6_forward: str
    nft: str
    iptables: str

    @classmethod
    def read(cls) -> "HostState":
        def out(argv):
            r = subprocess.run(argv, capture_output=True, text=True)
            return r.stdout if r.returncode == 0 else f"({argv[0]} failed)"
        return cls(Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
                   Path("/proc/sys/net/ipv6/conf/all/forwarding").read_text().strip(),
                   out(["nft", "list", "ruleset"]), out(["iptables-save"]) if shutil.which("iptables-save") else "")

    def differences(self, after: "HostState") -> list[str]:
        def strip(s):  # iptables-save's comment lines carry timestamps
            return "\n".join(l for l in s.splitlines() if not l.startswith("#"))
        d = []
        for field, label in (("ip_forward", "net.ipv4.ip_forward"), ("ip6_forward", "net.ipv6.conf.all.forwarding"),
                             ("nft", "the nftables ruleset"), ("iptables", "the iptables rules")):
            if strip(getattr(self, field)) != strip(getattr(after, field)):
                d.append(label)
        return d


class Host:
    """libvirt's daemons, the storage pool and the VM's network on this host."""

    RUN = Path("/run/kxlb-vagrant")

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log

    def virsh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(["virsh", "-q", "-c", "qemu:///system", *args], f"virsh {args[0]}", check=check, timeout=120)

    # daemons
    def _running(self, name: str) -> bool:
        return subprocess.run(["pgrep", "-x", name], capture_output=True).returncode == 0

    def start_daemons(self) -> None:
        self.RUN.mkdir(parents=True, exist_ok=True)
        Path("/var/log/libvirt/qemu").mkdir(parents=True, exist_ok=True)   # libvirt-daemon-system's, not installed
        for daemon in ("virtlogd", "libvirtd"):
            if not self._running(daemon):
                run([daemon, "-d"], f"start {daemon}")
                (self.RUN / f"{daemon}.started").touch()
                self.log(f"host: started {daemon}")
        for _ in range(100):
            if self.virsh("version", check=False).returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise VagrantLabError("libvirtd started but virsh cannot reach qemu:///system")
        if self.virsh("pool-info", POOL, check=False).returncode != 0:
            POOL_DIR.mkdir(parents=True, exist_ok=True)
            self.virsh("pool-define-as", POOL, "dir", "--target", str(POOL_DIR))
        if "running" not in self.virsh("pool-info", POOL).stdout:
            self.virsh("pool-start", POOL)

    def stop_daemons(self) -> None:
        for daemon in ("libvirtd", "virtlogd"):
            marker = self.RUN / f"{daemon}.started"
            if marker.exists():
                subprocess.run(["pkill", "-x", daemon], capture_output=True)
                for _ in range(50):
                    if not self._running(daemon):
                        break
                    time.sleep(0.1)
                marker.unlink()
                self.log(f"host: stopped {daemon}")

    def prepare(self, box: Box) -> None:
        """Everything `vagrant up` needs on the host: daemons, network, no stale VM, the box."""
        self.start_daemons()
        self.network_up()
        self.remove_leftover_vm()
        add_box(box, self.virsh)

    def remove_leftover_vm(self) -> None:
        """A VM a crashed run left (its .vagrant state may be gone with its checkout): the
        domain is ours by name, and a new `vagrant up` could not define it again."""
        if self.virsh("dominfo", VM_NAME, check=False).returncode == 0:
            self.virsh("destroy", VM_NAME, check=False)
            self.virsh("undefine", VM_NAME, "--remove-all-storage", check=False)
            self.log(f"host: removed the VM {VM_NAME} an earlier run left")

    # network
    def network_up(self) -> None:
        if not Path(f"/sys/class/net/{BRIDGE}").exists():
            run(["ip", "link", "add", BRIDGE, "type", "bridge"], "the VM's bridge")
            run(["ip", "addr", "add", HOST_CIDR, "dev", BRIDGE], "the bridge's address")
            run(["ip", "link", "set", BRIDGE, "up"], "bridge up")
        pidfile = self.RUN / "dnsmasq.pid"
        if not (pidfile.exists() and Path(f"/proc/{pidfile.read_text().strip()}").exists()):
            # Addresses only: no DNS (port 0), no router, no DNS server option.
            run(["dnsmasq", f"--interface={BRIDGE}", "--bind-interfaces", "--except-interface=lo",
                 "--port=0", f"--dhcp-range={DHCP_RANGE[0]},{DHCP_RANGE[1]},255.255.255.0,1h",
                 "--dhcp-option=3", "--dhcp-option=6", f"--pid-file={pidfile}",
                 f"--dhcp-leasefile={self.RUN / 'dnsmasq.leases'}", "--conf-file=/dev/null"], "dnsmasq")
        if self.virsh("net-info", NETWORK, check=False).returncode != 0:
            xml = self.RUN / "network.xml"
            xml.write_text(f"<network><name>{NETWORK}</name><forward mode='bridge'/>"
                           f"<bridge name='{BRIDGE}'/></network>")
            self.virsh("net-define", str(xml))
        if not re.search(r"Active:\s+yes", self.virsh("net-info", NETWORK).stdout):
            self.virsh("net-start", NETWORK)

    def network_down(self) -> None:
        if self._running("libvirtd") and self.virsh("net-info", NETWORK, check=False).returncode == 0:
            self.virsh("net-destroy", NETWORK, check=False)
            self.virsh("net-undefine", NETWORK, check=False)
        pidfile = self.RUN / "dnsmasq.pid"
        if pidfile.exists():
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pidfile.read_text().strip()), 15)
            pidfile.unlink()
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


# -- the VM --------------------------------------------------------------------------------------

class VM:
    """``vagrant`` in vagrant/ with the libvirt provider."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self.logs = REPO / "build" / "vagrant"

    def vagrant(self, *args: str, what: str | None = None, timeout: float = 3600, check: bool = True,
                log: str | None = None) -> subprocess.CompletedProcess:
        return run(["vagrant", *args], what or f"vagrant {args[0]}", cwd=VAGRANT_DIR, env=vagrant_env(),
                   timeout=timeout, check=check, log=self.logs / log if log else None)

    def up(self) -> float:
        t = time.monotonic()
        self.vagrant("up", "--provider=libvirt", log="up.log")
        return time.monotonic() - t

    def ssh(self, command: str, *, what: str, timeout: float = 3600, log: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        keepalive = ("-o", "ServerAliveInterval=30", "-o", "ServerAliveCountMax=20")  # 10 min unanswered
        return self.vagrant("ssh", "-c", command, "--", *keepalive, what=what, timeout=timeout, log=log, check=check)

    def run_detached(self, command: str, *, what: str, log: str, deadline: float, poll: float = 60) -> int:
        """Run *command* in the VM in a session of its own and wait for its exit code by
        polling, its output copied to build/vagrant/*log* at the end. A long run does not
        hang on one ssh connection: a VM starved of CPU under TCG (niced, beside the host's
        suite) can miss ssh's keepalives, and a dropped connection would hang the run up
        and lose its results. Returns the exit code; raises VagrantLabError when the run
        outlives *deadline* seconds or the VM stops answering."""
        d = "/tmp/kxlb-detached"
        body = f"{command} > {d}/out 2>&1; echo $? > {d}/rc.part && mv {d}/rc.part {d}/rc"
        # The braces put only the run in the background (a trailing & would take the whole
        # list, whose shell keeps ssh's output open until the run ends).
        self.ssh(f"rm -rf {d} && mkdir -p {d} && {{ setsid nohup sh -c {shlex.quote(body)} "
                 f"< /dev/null > /dev/null 2>&1 & }}", what=what, timeout=600)
        started, unanswered = time.monotonic(), 0
        while True:
            time.sleep(poll)
            try:
                r = self.ssh(f"cat {d}/rc 2>/dev/null || echo running", what=what, check=False, timeout=300)
                last = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
            except VagrantLabError:     # this poll's ssh hung: the next one asks again
                last = []
            unanswered = 0 if last else unanswered + 1
            if last and last[0] != "running":
                break
            if unanswered >= 10 or time.monotonic() - started > deadline:
                why = "stopped answering ssh" if unanswered >= 10 else f"was not done after {deadline:.0f}s"
                self._fetch(f"{d}/out", log)
                raise VagrantLabError(f"{what}: the VM {why} (log {self.logs / log}); its output ends: "
                                      + " | ".join(_tail(self.logs / log)))
        self._fetch(f"{d}/out", log)
        return int(last[0])

    def _fetch(self, path: str, log: str) -> None:
        r = self.ssh(f"cat {path}", what=f"the VM's {path}", check=False, timeout=600)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.logs / log).write_text(r.stdout)

    def destroy(self) -> None:
        self.vagrant("destroy", "-f", check=False, timeout=600)


@dataclass
class Results:
    tests: int
    failures: int
    errors: int
    skipped: int
    # "test id: first line of the failure" for each case that failed, errored or was skipped,
    # so that CI's output says which one without the VM's log (it goes with the clone).
    not_passed: tuple[str, ...] = ()

    @classmethod
    def from_junit(cls, xml: str) -> "Results":
        root = ET.fromstring(xml)
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        total = lambda a: sum(int(s.get(a, 0)) for s in suites)
        not_passed = []
        for case in root.iter("testcase"):
            for outcome in ("failure", "error", "skipped"):
                el = case.find(outcome)
                if el is not None:
                    first = (el.get("message") or el.text or "").strip().splitlines()[:1]
                    not_passed.append(f"{case.get('classname')}::{case.get('name')} ({outcome}): "
                                      f"{first[0][:300] if first else ''}")
        return cls(total("tests"), total("failures"), total("errors"), total("skipped"), tuple(not_passed))

    def ok(self) -> bool:
        return self.tests > 0 and not (self.failures or self.errors or self.skipped)

    def summary(self) -> str:
        return (f"{self.tests} tests, {self.failures} failed, {self.errors} errors, "
                f"{self.skipped} skipped")


def run_tests(log: Callable[[str], None] = print, keep: bool = False) -> int:
    """The whole of ``make vagrant-test``, one run at a time on a host. Returns the exit status."""
    with _flock(cache_dir() / ".vm.lock"):
        return _run_tests(log, keep)


def _keep_vm_niced(nice: int) -> None:
    """Lower the VM's QEMU threads (vCPUs included, as they appear) to *nice*: in CI the VM
    runs beside the suite, whose timing-sensitive lab tests must keep their CPU. libvirtd
    starts QEMU, so a nice of ours would not reach it."""
    import threading

    def loop():
        while True:
            r = subprocess.run(["pgrep", "-f", f"guest={VM_NAME},"], capture_output=True, text=True)
            for pid in r.stdout.split():
                with contextlib.suppress(OSError):
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        with contextlib.suppress(OSError):
                            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            time.sleep(5)
    threading.Thread(target=loop, daemon=True, name="vm-nice").start()


def _tail(path: Path, lines: int = 12) -> list[str]:
    """The last lines of a log, for CI's output (where the log itself is not kept)."""
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return [f"({path}: {e.strerror})"]


def _run_tests(log: Callable[[str], None], keep: bool) -> int:
    started = time.monotonic()
    if os.environ.get("KXLB_VAGRANT_NICE"):
        _keep_vm_niced(int(os.environ["KXLB_VAGRANT_NICE"]))
    before = HostState.read()
    host, vm = Host(log), VM(log)
    times: dict[str, float] = {}
    results = None
    try:
        t = time.monotonic()
        box = BoxBuild(log=log).ensure()
        times["box"] = time.monotonic() - t
        log(f"box: {box.path} ({'built' if box.built else 'cached'}, {times['box']:.0f}s)")
        t = time.monotonic()
        host.prepare(box)
        times["box add"] = time.monotonic() - t
        log("vm: vagrant up (set-up inside: scripts/setup.sh as the vagrant user, through sudo)")
        times["up"] = vm.up()
        log(f"vm: up and set up in {times['up']:.0f}s")
        t = time.monotonic()
        junit = "/tmp/kxlb-vm-junit.xml"
        tests = " ".join(f"'{t}'" for t in VM_TESTS)
        # The suite's 300 s per test guards against hangs at native speed; under TCG a compile
        # alone takes 2-5 minutes (more while the host is busy), so the VM's guard is longer.
        deselect = " ".join(f"--deselect '{t}'" for t in VM_DESELECT)
        rc = vm.run_detached(f"cd {VM_PROJECT} && sudo .venv/bin/python -m pytest -p no:cacheprovider -q -ra "
                             f"-o timeout={VM_TEST_TIMEOUT} --durations=15 --junitxml={junit} {tests} {deselect}",
                             what="the datapath tests in the VM", log="pytest.log", deadline=VM_TESTS_DEADLINE)
        times["tests"] = time.monotonic() - t
        xml = vm.ssh(f"cat {junit}", what="the tests' results", check=False).stdout
        if xml.strip().startswith("<?xml") or xml.strip().startswith("<testsuite"):
            results = Results.from_junit(xml)
            (vm.logs / "junit.xml").write_text(xml)
        log(f"vm: tests in {times['tests']:.0f}s: {results.summary() if results else 'no results'} "
            f"(log {vm.logs / 'pytest.log'})")
        for line in results.not_passed if results else ():
            log(f"vm: not passed: {line}")
        t = time.monotonic()
        demo = vm.ssh(f"cd {VM_PROJECT} && sudo .venv/bin/kxlb demo", what="the standalone demo in the VM",
                      log="demo.log", check=False)
        times["demo"] = time.monotonic() - t
        log(f"vm: standalone demo exit {demo.returncode} in {times['demo']:.0f}s (log {vm.logs / 'demo.log'})")
        if not results or rc:
            log("vm: the tests' output ends: " + " | ".join(_tail(vm.logs / "pytest.log")))
        if demo.returncode:
            log("vm: the demo's output ends: " + " | ".join(_tail(vm.logs / "demo.log")))
        ok = results is not None and results.ok() and rc == 0 and demo.returncode == 0
    finally:
        if not keep:
            t = time.monotonic()
            vm.destroy()
            host.network_down()
            host.stop_daemons()
            times["destroy"] = time.monotonic() - t
    if not keep:
        changed = before.differences(HostState.read())
        leftovers = [f"bridge {BRIDGE}"] if Path(f"/sys/class/net/{BRIDGE}").exists() else []
        if changed or leftovers:
            log(f"host: changed by the VM's run: {', '.join(changed + leftovers)}")
            ok = False
        else:
            log("host: forwarding, nftables and iptables as before; no bridge left")
    times["total"] = time.monotonic() - started
    log("times: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kxlb.lab.vagrant", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("box", help="build the box (cached) and print its path")
    t = sub.add_parser("test", help="box, vagrant up, the datapath tests and the demo inside, destroy")
    t.add_argument("--keep", action="store_true", help="leave the VM and its network up afterwards")
    sub.add_parser("up", help="box, network, vagrant up (leaves the VM running)")
    sub.add_parser("down", help="vagrant destroy, then the network and the daemons started here")
    a = p.parse_args(argv)
    log = lambda m: print(f"vagrant-lab: {m}", file=sys.stderr, flush=True)
    try:
        if a.cmd == "box":
            print(BoxBuild(log=log).ensure().path)
        elif a.cmd == "test":
            return run_tests(log, keep=a.keep)
        elif a.cmd == "up":
            Host(log).prepare(BoxBuild(log=log).ensure())
            VM(log).up()
        elif a.cmd == "down":
            host = Host(log)
            if host._running("libvirtd"):
                VM(log).destroy()
            host.network_down()
            host.stop_daemons()
    except VagrantLabError as e:
        log(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
