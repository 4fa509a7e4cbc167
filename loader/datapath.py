"""Load, attach, detach and unload the datapath: the loader's public operations."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from . import attach
from .attach import Attachment, Registry
from .compile import Datapath, compile_datapath
from .errors import KxlbError

BPF_FS_TYPE = "bpf"


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise KxlbError(f"{what} needs root (CAP_BPF, CAP_NET_ADMIN)")


def require_bpffs(pin_dir: str) -> None:
    """The pin directory must live on a bpf filesystem."""
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, typ, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (pin_dir == mnt or pin_dir.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    if fstype != BPF_FS_TYPE:
        raise KxlbError(f"{pin_dir} is not on a bpf filesystem (mount one: mount -t bpf bpf /sys/fs/bpf)")


def prepare_pin_dir(pin_dir: str) -> None:
    """Create the pin directory 0700, or check an existing one: whoever can write to it
    (or owns it) can put maps of their own under our names before we adopt them, or
    swap our pins. bpffs roots are often world-writable (mode 1777), so an existing
    directory must be root's and not group/world-writable."""
    require_bpffs(pin_dir)
    path = os.path.abspath(pin_dir)
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass  # made by someone else in the meantime: checked below like any existing one
        except OSError as exc:
            raise KxlbError(f"cannot create pin directory {d}: {exc.strerror}") from None
        else:
            os.chmod(d, 0o700)  # whatever the umask
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise KxlbError(f"pin directory {path} is not a directory (a symbolic link or a pinned object)")
    if st.st_uid != 0:
        raise KxlbError(f"pin directory {path} is owned by uid {st.st_uid}, not root: its owner could "
                        f"have put maps there for kxlb to adopt; remove it or choose another --pin-dir")
    if st.st_mode & 0o022:
        raise KxlbError(f"pin directory {path} has mode {stat.S_IMODE(st.st_mode):04o} (group- or "
                        f"world-writable): anyone could replace its pins; chmod 0700 it or choose another "
                        f"--pin-dir")


def load(ifaces: list[str], ns: str | None = None, xdp_mode: str | None = None,
         pin_dir: str = "/sys/fs/bpf/kxlb", force: bool = False,
         xdp_trust_checksums: bool = False) -> list[Attachment]:
    """Compile once (maps: create or adopt the pinned ones) and attach on each of
    ``ifaces``. ``xdp_mode`` None attaches at tc ingress, else XDP in 'generic' or
    'native' mode. Idempotent: attaching again replaces our program, and our program
    on the other hook is removed. See attach_one for ``force`` and
    ``xdp_trust_checksums``."""
    require_root("kxlb load")
    prepare_pin_dir(pin_dir)
    from .netns import netns_path
    netns_path(ns)  # fail on a missing namespace before compiling
    if xdp_mode and not xdp_trust_checksums:  # refuse before compiling or touching anything
        for iface in ifaces:
            check_xdp_placement(ns, iface, xdp_mode)
    dp = compile_datapath(pin_dir)
    Registry(pin_dir).record_pins()  # unload removes these, and only these
    return [attach_one(dp, iface, ns, xdp_mode, pin_dir, force=force, xdp_trust_checksums=xdp_trust_checksums)
            for iface in ifaces]


def check_xdp_placement(ns: str | None, iface: str, mode: str) -> None:
    """XDP belongs where frames come from a wire (docs/datapath.md, "Hooks and coexistence")."""
    why = attach.xdp_checksum_hazard(ns, iface, mode)
    if why:
        raise KxlbError(f"--xdp on {iface} refused: {why}; {attach.PARTIAL_CSUM_WHY}. Use tc (load without "
                        f"--xdp) on pod-facing and virtual devices and XDP on the physical uplink, or pass "
                        f"--xdp-trust-checksums if every sender on this link finalises its checksums")


def attach_one(dp: Datapath, iface: str, ns: str | None, xdp_mode: str | None, pin_dir: str,
               force: bool = False, xdp_trust_checksums: bool = False) -> Attachment:
    """Attach an already compiled datapath on one interface and record it.

    The new hook is attached before our program on the other hook is removed, so the
    interface is never without one. An XDP program kxlb did not attach is never replaced
    (XDP) or detached (tc) unless ``force``. XDP on a device where packets with partial
    checksums can arrive is refused unless ``xdp_trust_checksums``."""
    reg = Registry(pin_dir)
    recorded = reg.find(iface, ns)
    if xdp_mode:
        if not xdp_trust_checksums:
            check_xdp_placement(ns, iface, xdp_mode)
        ref = attach.attach_xdp(ns, iface, dp.xdp_fd, xdp_mode, recorded, force)
        attach.detach_tc(ns, iface, ("ingress",))
        a = Attachment(iface=iface, netns=ns, hook="xdp", mode=xdp_mode, prog_id=ref.id, prog_tag=ref.tag,
                       prog_name=ref.name)
    else:
        attach.attach_tc(ns, iface, dp.tc_fd)
        if recorded is not None and recorded.hook == "xdp":
            attach.detach_xdp(ns, iface, recorded)  # ours only: a foreign one stays
        a = Attachment(iface=iface, netns=ns, hook="tc")
    # Either way, ICMP errors the node sends about translated flows leave through tc egress.
    attach.attach_tc(ns, iface, dp.tc_egress_fd, "egress")
    attach.accept_local(ns, iface)
    reg.save([x for x in reg.load() if (x.iface, x.netns) != (iface, ns) or x.hook == "socklb"] + [a])
    return a


def _detach(a: Attachment, missing_ok: bool) -> str | None:
    """Detach one recorded attachment; returns a note when something was left."""
    try:
        if a.hook == "socklb":
            from .socklb import detach_socket_lb
            detach_socket_lb(a.iface)
        elif a.hook == "xdp":
            left = attach.detach_xdp(a.netns, a.iface, a)
            attach.detach_tc(a.netns, a.iface, ("egress",))
            if left is not None:
                return (f"XDP program on {a.iface} ({left}) is not the one kxlb attached "
                        f"(id {a.prog_id or '?'}): left attached")
        else:
            attach.detach_tc(a.netns, a.iface)
    except KxlbError:
        if not missing_ok:
            raise
    return None


@dataclass
class Unloaded:
    detached: list[Attachment] = field(default_factory=list)
    pins_removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what was left in place, and why


def unload(pin_dir: str = "/sys/fs/bpf/kxlb", iface: str | None = None, ns: str | None = None) -> Unloaded:
    """Detach from ``iface`` (in ``ns``), or, without ``iface``, from everywhere and
    remove the pins kxlb recorded making (never anything else in the directory). XDP
    programs are detached only if they are the ones kxlb attached. Idempotent."""
    require_root("kxlb unload")
    reg = Registry(pin_dir)
    items = reg.load()
    out = Unloaded()
    if iface:
        gone = [a for a in items if (a.iface, a.netns) == (iface, ns) and a.hook != "socklb"] \
            or [Attachment(iface, ns, "tc")]
        for a in gone:
            note = _detach(a, missing_ok=False)
            if note:
                out.notes.append(note)
        if not any(a.hook == "xdp" for a in gone) and attach.xdp_attached(ns, iface):
            out.notes.append(f"an XDP program kxlb has no record of attaching is on {iface}: left attached")
        reg.save([a for a in items if a not in gone])
        out.detached = gone
        return out
    for a in items:
        note = _detach(a, missing_ok=True)  # an interface or namespace may be gone already
        if note:
            out.notes.append(note)
    out.detached = items
    pins = reg.pins()
    for name in pins:
        if not name or name != os.path.basename(name) or name in (".", ".."):
            continue  # a hand-edited record never sends us outside the directory
        try:
            os.unlink(os.path.join(reg.pin_dir, name))
            out.pins_removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            out.notes.append(f"cannot remove pin {name}: {exc.strerror}")
    reg.remove()
    if os.path.isdir(reg.pin_dir):
        try:
            os.rmdir(reg.pin_dir)  # only when empty: never a tree, never someone else's pins
        except OSError:
            others = sorted(os.listdir(reg.pin_dir))
            out.notes.append(f"{reg.pin_dir} kept: it holds pins kxlb did not make ({', '.join(others[:5])}"
                             f"{', ...' if len(others) > 5 else ''})")
    return out
