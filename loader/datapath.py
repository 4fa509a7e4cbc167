"""Load, attach, detach and unload the datapath: the loader's public operations.

A load never leaves a half-changed node. It works in four steps, under the pin
directory's writer lock (loader/lock.py):

1. **Plan.** Every map this build declares (loader/mapspec.py) is compared with the pin
   of its name, before BCC sees it: the same layout and capacity is adopted; another
   capacity, or an older layout version (a pin of the same base name with a lower
   version), is migrated into a new map; anything else (a map of the right name whose
   sizes differ, a newer layout than this build knows) refuses the load with one line,
   and nothing has been touched.
2. **Stage.** The build is compiled into a staging directory inside the pin directory:
   adopted maps are hard links to the live pins (the same maps), the others are created
   there by BCC. A compile or verifier failure removes the staging directory: the
   running datapath never noticed.
3. **Switch.** Migrated maps get the old maps' contents (conntrack included), every
   place the datapath is attached (recorded in the registry: tc, XDP, socket hooks) gets
   the new programs, and the maps the datapath writes are copied once more, for the
   flows the old programs created meanwhile. A failure here puts the old programs back.
4. **Commit.** The staged pins replace the live ones (rename), the old layouts' pins go.

When the plan adopts every map and the pinned programs were compiled from this very
build (the registry's digest), nothing is compiled: a restarting controller attaches in
milliseconds instead of compiling for tens of seconds on a busy node.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

from . import attach, bpfsys, devconf, migrate
from .compile import Datapath, build_digest, compile_datapath, pinned_datapath
from .errors import KxlbError
from .mounts import require_bpffs
from .lock import WriterLock
from .mapspec import MapSpec, datapath_specs, known_pins, pin_name, released_layouts, split_pin
from .registry import Attachment, Registry, legacy_path

DEFAULT_PIN_DIR = "/sys/fs/bpf/kxlb"
STAGING = "staging"  # bpffs refuses names with a dot
BUILD_RECORD = "build"


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise KxlbError(f"{what} needs root (CAP_BPF, CAP_NET_ADMIN)")


def prepare_pin_dir(pin_dir: str) -> None:
    """Create the pin directory 0700, or check an existing one: whoever can write to it
    (or owns it) can put maps of their own under our names before we adopt them, or
    swap our pins. bpffs roots are often world-writable (mode 1777), so an existing
    directory must be root's and not group/world-writable, and so must every directory
    above it (or be sticky)."""
    require_bpffs(pin_dir)
    path = os.path.abspath(pin_dir)
    _check_pin_dir_ancestors(path)  # before anything is made below them
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
    _check_pin_dir_ancestors(path)  # again: one made by someone else in the meantime
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


def _check_pin_dir_ancestors(path: str) -> None:
    """Every directory above the pin directory: whoever may rename or replace one of them
    can swap the whole pin directory for their own. Each must be root's and writable by
    root only, or sticky (as a 1777 bpffs root is: there only an entry's owner may move it,
    and the entry below is checked in turn). A symbolic link on the way must be root's: its
    owner could point it elsewhere after this check."""
    p = path
    while os.path.dirname(p) != p:
        p = os.path.dirname(p)
        if not os.path.lexists(p):
            continue  # made below, root's and 0700
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) and st.st_uid != 0:
            raise KxlbError(f"pin directory {path}: {p} above it is a symbolic link owned by uid {st.st_uid}, "
                            f"not root: its owner could point it elsewhere; choose another --pin-dir")
    d = os.path.realpath(os.path.dirname(path))
    while not os.path.exists(d):
        d = os.path.dirname(d)
    while True:
        st = os.stat(d)
        if st.st_uid != 0:
            raise KxlbError(f"pin directory {path}: {d} above it is owned by uid {st.st_uid}, not root: its "
                            f"owner could replace the pin directory; choose another --pin-dir")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise KxlbError(f"pin directory {path}: {d} above it has mode {stat.S_IMODE(st.st_mode):04o} "
                            f"(group- or world-writable, not sticky): anyone could replace the pin directory; "
                            f"choose another --pin-dir")
        if os.path.dirname(d) == d:
            return
        d = os.path.dirname(d)


# --- 1. the plan ------------------------------------------------------------------------------
@dataclass
class MapPlan:
    spec: MapSpec
    action: str                     # "adopt", "create", "migrate"
    source: str | None = None       # migrate: the live pin the contents come from
    why: str = ""                   # migrate: what differs
    converters: list = field(default_factory=list)


@dataclass
class Plan:
    maps: list[MapPlan]
    stale: list[str]                # live pins of older layouts to remove at commit

    @property
    def adopts_everything(self) -> bool:
        return all(m.action == "adopt" for m in self.maps if m.spec.stateful)

    @property
    def migrations(self) -> list[MapPlan]:
        return [m for m in self.maps if m.action == "migrate"]


def _pinned_info(path: str):
    try:
        fd = bpfsys.obj_get(path)
    except OSError:
        return None
    try:
        return bpfsys.map_info(fd)
    finally:
        os.close(fd)


def plan(pin_dir: str, specs: dict[str, MapSpec]) -> Plan:
    """What a load of ``specs`` does with each pin of ``pin_dir`` (refusing with one line
    when a pin cannot be adopted or migrated: nothing is changed then)."""
    present = set(os.listdir(pin_dir))
    released = released_layouts()
    out, stale = [], []
    for spec in specs.values():
        if not spec.stateful:
            out.append(MapPlan(spec, "create"))  # program arrays: every build makes its own
            continue
        versions = sorted(v for p in present for b, v in [split_pin(p)] if b == spec.base)
        newer = [v for v in versions if v > spec.version]
        if newer:
            raise KxlbError(f"{pin_dir} holds map {spec.base} in layout version {newer[-1]}, which is newer than "
                            f"this kxlb knows ({spec.version}): it was loaded by a newer kxlb; load that release, "
                            f"or roll back as docs/operations.md says")
        live = os.path.join(pin_dir, spec.pin)
        older = [v for v in versions if v < spec.version]
        stale += [pin_name(spec.base, v) for v in older]
        if spec.pin in present:
            info = _pinned_info(live)
            if info is None:
                raise KxlbError(f"{live} is not a map kxlb can open: remove it or choose another --pin-dir")
            diff = spec.mismatch(info)
            if diff is None:
                out.append(MapPlan(spec, "adopt"))
            elif (info.type, info.key_size, info.value_size, info.map_flags) == \
                    (spec.map_type, spec.key_size, spec.value_size, spec.flags):
                out.append(MapPlan(spec, "migrate", live, f"capacity {info.max_entries} -> {spec.max_entries}"))
            else:
                raise KxlbError(f"{live} is not this kxlb's layout {spec.version} of {spec.base} ({diff}): another "
                                f"build or tool made it; kxlb leaves it alone (`kxlb cleanup` removes kxlb's pins, "
                                f"or choose another --pin-dir)")
            continue
        if not older:
            out.append(MapPlan(spec, "create"))
            continue
        frm = older[-1]
        source = os.path.join(pin_dir, pin_name(spec.base, frm))
        steps = migrate.path(spec.base, frm, spec.version)
        if (spec.base, frm) not in released or steps is None:
            if spec.base not in migrate.DISPOSABLE:
                raise KxlbError(f"{source}: this kxlb cannot convert {spec.base} from layout {frm} to "
                                f"{spec.version}; upgrade through the release that introduced layout {frm + 1}")
            out.append(MapPlan(spec, "create"))  # starts empty; the old one goes at commit
            continue
        out.append(MapPlan(spec, "migrate", source, f"layout {frm} -> {spec.version}", steps))
    return Plan(out, stale)


# --- 2.-4. stage, switch, commit --------------------------------------------------------------
@dataclass
class Prepared:
    """A datapath ready to attach, and what the load did to get it."""

    dp: Datapath
    compiled: bool
    migrated: list[str] = field(default_factory=list)     # "conntrack: capacity 65536 -> 262144 (1234 entries)"
    reattached: list[Attachment] = field(default_factory=list)


def prepare(pin_dir: str, reg: Registry, extra_cflags: list[str] | None = None,
            the_plan: Plan | None = None) -> Prepared:
    """Make ``pin_dir`` hold this build's datapath (the caller holds the writer lock):
    adopt it as it is, or stage, switch and commit a new one (the module's docstring)."""
    specs = datapath_specs(extra_cflags)
    the_plan = the_plan or plan(pin_dir, specs)
    dp = reusable(pin_dir, reg, the_plan, extra_cflags)
    if dp is not None:
        return Prepared(dp, compiled=False)
    digest = build_digest(extra_cflags)
    staging = os.path.join(pin_dir, STAGING)
    _remove_staging(staging)
    os.mkdir(staging, 0o700)
    switched: list[Attachment] = []
    try:
        for m in the_plan.maps:
            if m.action == "adopt":
                os.link(os.path.join(pin_dir, m.spec.pin), os.path.join(staging, m.spec.pin))
        dp = compile_datapath(staging, extra_cflags)
        from .socklb import compile_sock
        compile_sock(staging, extra_cflags)
        migrated = _copy(the_plan, staging, only_new=False)
        _fill_filters(staging)
        switched = _switch(reg, staging, dp)
        _copy(the_plan, staging, only_new=True)  # what the old programs wrote meanwhile
    except BaseException:
        _switch_back(reg, pin_dir, switched)
        _remove_staging(staging)
        raise
    _commit(pin_dir, staging, the_plan)
    reg.put(BUILD_RECORD, {"digest": digest, "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "programs": _program_ids(dp),
                           "layouts": {s.base: s.version for s in specs.values() if s.stateful}})
    return Prepared(dp, compiled=True, migrated=migrated, reattached=switched)


def reusable(pin_dir: str, reg: Registry, the_plan: Plan, extra_cflags: list[str] | None = None) -> Datapath | None:
    """The pinned programs, when they are exactly what this build would load over maps it
    adopts as they are (None: prepare must compile). Loads no compiler: a controller
    restarting with the same build attaches in milliseconds."""
    done = reg.get(BUILD_RECORD) or {}
    if not the_plan.adopts_everything or the_plan.stale or done.get("digest") != build_digest(extra_cflags):
        return None
    try:
        dp = pinned_datapath(pin_dir)
    except KxlbError:
        return None  # a program pin is missing
    # The pins must still be the programs that build made: another release's load (a roll
    # back) re-pins its own under the same names.
    if _program_ids(dp) == done.get("programs"):
        return dp
    for fd in (dp.tc_fd, dp.xdp_fd, dp.tc_egress_fd):
        os.close(fd)
    return None


def _fill_filters(staging: str) -> None:
    """The address filters' bits for what the staged maps hold (loader/filters.py): new
    filters over an older release's services and flows start complete. Flows the old
    programs make meanwhile go to backends the slots name, whose bits are in (no writer
    runs: the caller holds the lock)."""
    from .filters import AddressFilters
    from .maps import Maps

    with Maps.open(staging) as maps:
        AddressFilters(maps).fill(maps)


def _program_ids(dp: Datapath) -> list[int]:
    return [attach.prog_ref(fd).id for fd in (dp.tc_fd, dp.xdp_fd, dp.tc_egress_fd)]


def _copy(the_plan: Plan, staging: str, only_new: bool) -> list[str]:
    """Each migrated map's old contents into its staged new map: copied (another
    capacity) or converted (another layout: into the new map and the maps its layout
    adds, loader/migrate.py)."""
    out = []
    for m in the_plan.migrations:
        fds: list[int] = []
        try:
            old = bpfsys.obj_get(m.source)
            fds.append(old)
            if m.converters:
                targets, sources = {}, {}
                for other in the_plan.maps:
                    fd = bpfsys.obj_get(os.path.join(staging, other.spec.pin))
                    fds.append(fd)
                    targets[migrate.SELF if other is m else other.spec.base] = migrate._RawMap(fd)
                for other in the_plan.migrations:   # what the others convert from, for reading
                    fd = bpfsys.obj_get(other.source)
                    fds.append(fd)
                    sources[other.spec.base] = migrate._RawMap(fd)
                res = migrate.convert(old, migrate.Targets(targets, only_new, sources), m.converters)
            else:
                new = bpfsys.obj_get(os.path.join(staging, m.spec.pin))
                fds.append(new)
                res = migrate.copy(old, new, only_new)
        finally:
            for fd in fds:
                os.close(fd)
        if res.failed and not only_new and not m.converters:
            raise KxlbError(f"migrating {m.spec.base} ({m.why}): {res.failed} entries do not fit the new map "
                            f"({res.copied} did); nothing was changed")
        out.append(f"{m.spec.base}: {m.why} ({res.copied} entries" +
                   (f", {res.failed} that the new layout cannot hold" if res.failed else "") + ")")
    return out


def _switch(reg: Registry, staging: str, dp: Datapath) -> list[Attachment]:
    """Attach the staged programs everywhere the registry says the datapath is; returns
    what was switched, in order (so a failure can switch exactly those back)."""
    from .socklb import attach_sock_programs, pinned_sock_programs

    switched: list[Attachment] = []
    sock = None
    try:
        for a in reg.attachments():
            if a.hook == "socklb":
                if not os.path.isdir(a.iface):
                    reg.forget(a)  # the cgroup is gone, and its programs with it
                    continue
                sock = sock or pinned_sock_programs(staging)
                attach_sock_programs(sock, a.iface)
                switched.append(a)
                continue
            try:
                attach.interface_exists(a.netns, a.iface)
            except KxlbError:
                reg.forget(a)  # a pod's veth that went away, or its namespace
                continue
            reg.record(_attach_hooks(dp, a.iface, a.netns, a.mode if a.hook == "xdp" else None, a))
            switched.append(a)
    finally:
        for fd in (sock or {}).values():
            os.close(fd)
    return switched


def _switch_back(reg: Registry, pin_dir: str, switched: list[Attachment]) -> None:
    """After a failed switch: the live (old) programs go back where the new ones went."""
    if not switched:
        return
    from .socklb import attach_sock_programs, pinned_sock_programs

    old = pinned_datapath(pin_dir)
    sock = pinned_sock_programs(pin_dir)
    for a in switched:
        try:
            if a.hook == "socklb":
                if sock:
                    attach_sock_programs(sock, a.iface)
            else:
                reg.record(_attach_hooks(old, a.iface, a.netns, a.mode if a.hook == "xdp" else None,
                                         reg.find(a.iface, a.netns)))
        except KxlbError:
            pass  # best effort: the error that started this is the one to report
    for fd in (sock or {}).values():
        os.close(fd)


def _commit(pin_dir: str, staging: str, the_plan: Plan) -> None:
    """The staged pins become the live ones; older layouts' pins and migrated maps go."""
    for name in sorted(os.listdir(staging)):
        src, dst = os.path.join(staging, name), os.path.join(pin_dir, name)
        if os.path.lexists(dst) and os.stat(dst).st_ino == os.stat(src).st_ino:
            os.unlink(src)        # an adopted map: the live pin is this very link
        else:
            os.replace(src, dst)  # atomically: the name never points nowhere
    for name in the_plan.stale:
        try:
            os.unlink(os.path.join(pin_dir, name))
        except FileNotFoundError:
            pass
    os.rmdir(staging)


def _remove_staging(staging: str) -> None:
    """A staging directory holds only links and new pins (never the only link to a live
    map): removing it loses nothing."""
    if os.path.isdir(staging):
        for name in os.listdir(staging):
            os.unlink(os.path.join(staging, name))
        os.rmdir(staging)


# --- attach -----------------------------------------------------------------------------------
def check_xdp_placement(ns: str | None, iface: str, mode: str) -> None:
    """XDP belongs where frames come from a wire (docs/datapath.md, "Hooks and coexistence")."""
    why = attach.xdp_checksum_hazard(ns, iface, mode)
    if why:
        raise KxlbError(f"--xdp on {iface} refused: {why}; {attach.PARTIAL_CSUM_WHY}. Use tc (load without "
                        f"--xdp) on pod-facing and virtual devices and XDP on the physical uplink, or pass "
                        f"--xdp-trust-checksums if every sender on this link finalises its checksums")


def _attach_hooks(dp: Datapath, iface: str, ns: str | None, xdp_mode: str | None,
                  recorded: Attachment | None, force: bool = False) -> Attachment:
    """Our programs on one interface: ingress (tc or XDP) and tc egress. The new hook is
    attached before our program on the other hook is removed, so the interface is never
    without one."""
    if xdp_mode:
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
    devconf.prepare_interface(ns, iface)  # accept_local, rp_filter loose (loader/devconf.py)
    return a


def attach_one(dp: Datapath, iface: str, ns: str | None, xdp_mode: str | None, pin_dir: str,
               force: bool = False, xdp_trust_checksums: bool = False, reg: Registry | None = None) -> Attachment:
    """Attach an already prepared datapath on one interface and record it (the caller
    holds the writer lock). An XDP program kxlb did not attach is never replaced (XDP) or
    detached (tc) unless ``force``. XDP on a device where packets with partial checksums
    can arrive is refused unless ``xdp_trust_checksums``."""
    attach.require_ethernet(ns, iface)  # the controller's interface patterns may match a tunnel
    if xdp_mode and not xdp_trust_checksums:
        check_xdp_placement(ns, iface, xdp_mode)
    own = reg is None
    reg = reg or Registry(pin_dir, create=True)
    try:
        a = _attach_hooks(dp, iface, ns, xdp_mode, reg.find(iface, ns), force)
        reg.record(a)
    finally:
        if own:
            reg.close()
    return a


def load(ifaces: list[str], ns: str | None = None, xdp_mode: str | None = None,
         pin_dir: str = DEFAULT_PIN_DIR, force: bool = False, xdp_trust_checksums: bool = False,
         wait: float = 0.0, extra_cflags: list[str] | None = None) -> tuple[Prepared, list[Attachment]]:
    """Prepare this build's datapath in ``pin_dir`` (compile only when needed, migrate
    what changed) and attach it on each of ``ifaces``. Everything that can be refused is
    checked before anything changes: root, the namespace, the interfaces, XDP placement,
    the pin directory, the maps' layouts. A load that fails leaves what was there
    before (a pin directory it created included). Idempotent."""
    require_root("kxlb load")
    from .netns import netns_path
    netns_path(ns)
    for iface in ifaces:
        attach.require_ethernet(ns, iface)  # "not found" first, as interface_exists says it
        if xdp_mode and not xdp_trust_checksums:
            check_xdp_placement(ns, iface, xdp_mode)
    created = not os.path.lexists(pin_dir)
    prepare_pin_dir(pin_dir)
    done: list[Attachment] = []
    try:
        with WriterLock(pin_dir).acquire(wait):
            the_plan = plan(pin_dir, datapath_specs(extra_cflags))
            with Registry(pin_dir, create=True) as reg:
                prepared = prepare(pin_dir, reg, extra_cflags, the_plan)
                for iface in ifaces:
                    done.append(attach_one(prepared.dp, iface, ns, xdp_mode, pin_dir, force=force,
                                           xdp_trust_checksums=xdp_trust_checksums, reg=reg))
    except BaseException:
        if created:  # a first load: nothing of kxlb's was here, so nothing may stay
            for a in done:
                _detach(a, missing_ok=True)
            remove_pins(pin_dir)
        raise
    return prepared, done


# --- detach -----------------------------------------------------------------------------------
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
    except Exception as exc:  # KxlbError, or pyroute2's NetlinkError for a device gone meanwhile
        gone = isinstance(exc, KxlbError) or attach.device_gone(exc)
        if not (missing_ok and gone):
            raise
    return None


@dataclass
class Unloaded:
    detached: list[Attachment] = field(default_factory=list)
    pins_removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what was left in place, and why


def unload(pin_dir: str = DEFAULT_PIN_DIR, iface: str | None = None, ns: str | None = None,
           wait: float = 0.0) -> Unloaded:
    """Detach from ``iface`` (in ``ns``), or, without ``iface``, from everywhere and
    remove kxlb's pins (never anything else in the directory). XDP programs are
    detached only if they are the ones kxlb attached. Idempotent."""
    require_root("kxlb unload")
    out = Unloaded()
    if not os.path.isdir(pin_dir):
        _forget_legacy(pin_dir)
        return out
    legacy = os.path.exists(legacy_path(pin_dir))  # kxlb 0.1's record: its registry is imported
    with WriterLock(pin_dir).acquire(wait), Registry(pin_dir, create=legacy) as reg:
        if reg.fd < 0:
            out.notes.append(f"{pin_dir} has no kxlb registry (kxlb never loaded there): nothing removed")
            return out
        items = reg.attachments()
        if iface:
            gone = [a for a in items if (a.iface, a.netns) == (iface, ns) and a.hook != "socklb"] \
                or [Attachment(iface, ns, "tc")]
            for a in gone:
                note = _detach(a, missing_ok=False)
                if note:
                    out.notes.append(note)
                if a in items:
                    reg.forget(a)
            if not any(a.hook == "xdp" for a in gone) and attach.xdp_attached(ns, iface):
                out.notes.append(f"an XDP program kxlb has no record of attaching is on {iface}: left attached")
            out.detached = gone
            return out
        for a in items:
            note = _detach(a, missing_ok=True)  # an interface or namespace may be gone already
            if note:
                out.notes.append(note)
        out.detached = items
        out.pins_removed, notes = remove_pins(pin_dir)
        out.notes += notes
    _forget_legacy(pin_dir)
    return out


def remove_pins(pin_dir: str) -> tuple[list[str], list[str]]:
    """Remove every pin kxlb makes (any release's names, loader/mapspec.py known_pins),
    a staging directory left by a killed load, then the directory if it is empty; never
    a pin kxlb did not name. Returns (removed, notes)."""
    removed, notes = [], []
    _remove_staging(os.path.join(pin_dir, STAGING))
    mine = known_pins()
    for name in sorted(os.listdir(pin_dir)):
        if name not in mine:
            continue
        try:
            os.unlink(os.path.join(pin_dir, name))
            removed.append(name)
        except OSError as exc:
            notes.append(f"cannot remove pin {name}: {exc.strerror}")
    try:
        os.rmdir(pin_dir)  # only when empty: never a tree, never someone else's pins
    except OSError:
        if os.path.isdir(pin_dir):
            others = sorted(os.listdir(pin_dir))
            notes.append(f"{pin_dir} kept: it holds pins kxlb did not make ({', '.join(others[:5])}"
                         f"{', ...' if len(others) > 5 else ''})")
    return removed, notes


def _forget_legacy(pin_dir: str) -> None:
    """kxlb 0.1's record file of this directory, if one is left."""
    try:
        os.unlink(legacy_path(pin_dir))
    except FileNotFoundError:
        pass
