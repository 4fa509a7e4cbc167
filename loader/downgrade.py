"""`kxlb downgrade --to RELEASE`: make a pin directory loadable by an older release,
keeping its flows.

A release adopts only the pins of its own layouts (loader/mapspec.py): an older one
finds conntrack's layout 1 under `conntrack`, never the layout 2 this one keeps under
`conntrack_v2`. So before the older release loads (its `kxlb load`, or its DaemonSet),
this release writes the older layouts' maps from its own (loader/ct_migrate.py: each flow
of a record as the two entries layout 1 kept), pins them under their names, and takes
its own layouts' pins away (the programs running now keep their maps until the older
release's programs replace them). Maps the older release does not have go the same way;
socket hooks are attached again exclusively, as the older release attaches its own.

The window: flows that start between this command and the older release's switch live
only in this release's maps, and are lost with them (their packets start new flows). Run
the two one right after the other.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from . import bpfsys, migrate
from .errors import KxlbError
from .lock import WriterLock
from .mapspec import LAYOUTS_FILE, MAP_TYPES, datapath_specs, pin_name
from .registry import Registry
from .svc_migrate import BACKEND_KEY_V1, SVC_VALUE_V1

OLD_SPECS = {  # (base, version): (type, key size, value size, flags, capacity from this build's)
    ("conntrack", 1): (MAP_TYPES["lru_hash"], 16, 48, 0, lambda records: 2 * records),
    ("conntrack6", 1): (MAP_TYPES["lru_hash"], 40, 96, 0, lambda records: 2 * records),
    # BPF_F_NO_PREALLOC (1); the sizes of layout 1 as loader/svc_migrate.py declares it
    ("services", 1): (MAP_TYPES["hash"], 8, SVC_VALUE_V1.size, 1, lambda n: n),
    ("services6", 1): (MAP_TYPES["hash"], 20, SVC_VALUE_V1.size, 1, lambda n: n),
    ("backends", 1): (MAP_TYPES["hash"], BACKEND_KEY_V1.size, 8, 1, lambda n: n),
    ("backends6", 1): (MAP_TYPES["hash"], BACKEND_KEY_V1.size, 20, 1, lambda n: n),
}
"""How to make the older layouts' maps: layout 1 of conntrack kept two entries per flow;
layout 1 of the slot maps was a hash keyed by (svc_id, slot, gen, set)."""

STAGING = "downgrade"


def _release_key(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def layouts_of(release: str) -> dict[str, int]:
    """base -> the layout version ``release`` used (bpf/layouts.txt: each line's release is
    the one that introduced it). Maps the release did not have are absent."""
    if not re.fullmatch(r"\d+(\.\d+)*", release):
        raise KxlbError(f"release {release!r}: expected a version such as 0.1.0")
    want = _release_key(release)
    out: dict[str, int] = {}
    known: set[str] = set()
    for line in LAYOUTS_FILE.read_text().splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s+\w+\s*#\s*([\d.]+)", line)
        if not m:
            continue
        base, version, since = m.group(1), int(m.group(2)), _release_key(m.group(3))
        known.add(m.group(3))
        if since <= want and version >= out.get(base, 0):
            out[base] = version
    if release not in known:
        raise KxlbError(f"release {release!r}: bpf/layouts.txt knows {', '.join(sorted(known))}")
    return out


@dataclass
class Downgraded:
    converted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def downgrade(pin_dir: str, release: str, wait: float = 0.0) -> Downgraded:
    from .ct_migrate import downgrade_converters
    from .maps import Maps
    from .services import ServiceTable

    target = layouts_of(release)
    out = Downgraded()
    if not os.path.isdir(pin_dir):
        raise KxlbError(f"no datapath pinned at {pin_dir}")
    with WriterLock(pin_dir).acquire(wait), Registry(pin_dir) as reg:
        with Maps.open(pin_dir) as maps:
            snat = ServiceTable(maps).read_config().snat_addrs
        steps_down = {**downgrade_converters(snat),
                      **{k: v for k, v in migrate.CONVERTERS.items() if k[0].startswith(("services", "backends"))}}
        staging = os.path.join(pin_dir, STAGING)
        os.makedirs(staging, 0o700, exist_ok=True)
        made: list[tuple[str, str]] = []     # (staged pin, final name)
        fds: list[int] = []
        try:
            # First every older map, staged; then the conversions, each of which may write
            # others' staged maps (services writes its family's slots) and read others' live
            # ones (loader/svc_migrate.py).
            todo = []
            for spec in datapath_specs().values():
                if not spec.stateful or target.get(spec.base) == spec.version:
                    continue
                live = os.path.join(pin_dir, spec.pin)
                if not os.path.exists(live):
                    continue
                tv = target.get(spec.base)
                if tv is None:
                    out.removed.append(spec.pin)  # the older release has no such map
                    continue
                chain = [steps_down.get((spec.base, v, v - 1)) for v in range(spec.version, tv, -1)]
                if None in chain or (spec.base, tv) not in OLD_SPECS:
                    raise KxlbError(f"this kxlb cannot write {spec.base} in layout {tv} (release {release})")
                mtype, ksize, vsize, flags, cap = OLD_SPECS[(spec.base, tv)]
                fd = bpfsys.map_create(mtype, f"kxlb_{spec.base}"[:15], ksize, vsize, cap(spec.max_entries), flags)
                fds.append(fd)
                staged = os.path.join(staging, pin_name(spec.base, tv))
                bpfsys.obj_pin(fd, staged)
                made.append((staged, os.path.join(pin_dir, pin_name(spec.base, tv))))
                old = bpfsys.obj_get(live)
                fds.append(old)
                todo.append((spec, tv, chain, fd, old))
            staged_maps = {spec.base: migrate._RawMap(fd) for spec, _, _, fd, _ in todo}
            live_maps = {spec.base: migrate._RawMap(old) for spec, _, _, _, old in todo}
            for spec, tv, chain, fd, old in todo:
                maps_ = {**staged_maps, migrate.SELF: staged_maps[spec.base]}
                del maps_[spec.base]
                res = migrate.convert(old, migrate.Targets(maps_, False, live_maps), chain)
                out.removed.append(spec.pin)
                out.converted.append(f"{spec.base}: layout {spec.version} -> {tv} ({res.copied} entries"
                                     + (f", {res.failed} it cannot hold" if res.failed else "") + ")")
        except BaseException:
            for staged, _ in made:
                os.unlink(staged)
            os.rmdir(staging)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        for staged, final in made:
            os.replace(staged, final)
        os.rmdir(staging)
        for pin in out.removed:
            os.unlink(os.path.join(pin_dir, pin))   # the running programs keep their maps
        from .socklb import make_exclusive
        for a in reg.attachments():
            if a.hook == "socklb" and os.path.isdir(a.iface):
                out.notes += make_exclusive(a.iface)
        reg.put("downgraded", {"to": release})
    return out
