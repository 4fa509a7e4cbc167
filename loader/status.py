"""What `kxlb status` reports about a node's datapath, gathered without writing anything:
the build loaded, who writes the maps now (and whether that controller is healthy), an
interrupted write waiting for repair, where the programs are attached (and whether our
program is still the one there), how full each map is (and the masquerade port range:
an array is never "full", its live ways are what count), and what was dropped or
rejected, by reason."""
from __future__ import annotations

import os
import re
import urllib.request

from . import attach, bpfsys
from .datapath import BUILD_RECORD
from .journal import INTENT
from .conntrack import masq_usage
from .layout import BPF_DIR, DP_COUNTERS, FAMILIES, C
from .errors import KxlbError
from .lock import holders
from .mapspec import datapath_specs
from .migrate import _RawMap
from .registry import Attachment, Registry


def _counter_kinds() -> dict[str, str]:
    """dp_stats counter -> "dropped" / "rejected", from consts.h's comment of each KXLB_ST_."""
    out = {}
    for m in re.finditer(r"#define\s+KXLB_ST_(\w+)\s+\d+\s*/\*(.*?)\*/", (BPF_DIR / "consts.h").read_text()):
        for kind in ("dropped", "rejected"):
            if kind in m.group(2):
                out[m.group(1).lower()] = kind
    return out


def _attached(a: Attachment) -> str:
    """Whether our program is still attached where the record says."""
    try:
        if a.hook == "socklb":
            from .socklb import HOOKS
            import json
            import subprocess
            r = subprocess.run(["bpftool", "-j", "cgroup", "show", a.iface], capture_output=True, text=True)
            names = {p.get("name") for p in json.loads(r.stdout.strip() or "[]")}
            return "ok" if set(HOOKS) <= names else "missing"
        if a.hook == "xdp":
            progs = attach.xdp_programs(a.netns, a.iface)
            return "ok" if any(attach.is_ours(pid, a) for pid in progs.values()) else "missing"
        return "ok" if attach.tc_attached(a.netns, a.iface) else "missing"
    except Exception as exc:  # noqa: BLE001 (an interface or namespace that went away)
        return f"gone ({exc})"


def _fill(pin_dir: str) -> dict[str, dict[str, int]]:
    out = {}
    for pin, spec in datapath_specs().items():
        if not spec.stateful or spec.map_type in (2, 6, 12):  # arrays: always "full"
            continue
        try:
            fd = bpfsys.obj_get(os.path.join(pin_dir, pin))
        except OSError:
            continue
        try:
            raw = _RawMap(fd)
            n = raw.count()
            out[pin] = {"entries": n, "capacity": raw.max_entries}
        finally:
            os.close(fd)
    out.update(_slots_used(pin_dir))
    return out


def _slots_used(pin_dir: str) -> dict[str, dict[str, int]]:
    """The backend arrays' slots in use: the runs the frontends name (an array itself has
    no count of entries)."""
    from .maps import Maps
    from .services import slots_named

    out = {}
    try:
        maps = Maps.open(pin_dir)
    except KxlbError:
        return out
    with maps:
        for fam in FAMILIES:
            m = fam.map(maps, "backends")
            out[os.path.basename(m.path)] = {"entries": slots_named(maps, fam),
                                             "capacity": m.max_entries - 1}   # slot 0 is never used
    return out


def _health(writer: dict) -> str:
    url = writer.get("health")
    if not url:
        return ""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return f"{url} {r.status}"
    except Exception as exc:  # noqa: BLE001
        code = getattr(exc, "code", None)
        return f"{url} {code or exc}"


def status(pin_dir: str) -> dict:
    from .maps import Maps
    from .services import ServiceTable

    out: dict = {"pin_dir": os.path.abspath(pin_dir), "loaded": os.path.isdir(pin_dir)}
    if not out["loaded"]:
        return out
    with Registry(pin_dir) as reg:
        out["build"] = reg.get(BUILD_RECORD)
        writer = reg.get("writer") or {}
        lockers = [str(h) for h in holders(pin_dir)]
        out["writer"] = {"holders": lockers, **writer, "health_check": _health(writer)} if lockers else None
        out["interrupted_write"] = reg.get(INTENT)
        out["attachments"] = [{"hook": a.hook, "where": a.iface, "netns": a.netns, "mode": a.mode,
                               "state": _attached(a)} for a in reg.attachments()]
        out["registry"] = reg.fd >= 0
    out["maps"] = _fill(pin_dir)
    kinds = _counter_kinds()
    out["masquerade_ports"] = {}
    try:
        with Maps.open(pin_dir) as maps:
            table = ServiceTable(maps)
            counters = table.datapath_counters()
            first, last = table.read_config().src_ports or (C["SRC_PORT_MIN"], C["SRC_PORT_MAX"])
            for fam in FAMILIES:
                u = masq_usage(maps, fam, first, last)
                out["masquerade_ports"][fam.name] = {"range": [first, last], "ports_in_use": u.ports_used,
                                                     "ports": u.ports, "flows": u.ways_used}
    except Exception as exc:  # noqa: BLE001 (maps of another layout: said by `load`)
        out["counters_error"] = str(exc)
        counters = {}
    out["drops"] = {name: {"count": counters.get(name, 0), "kind": kinds[name]}
                    for name in sorted(kinds) if name in DP_COUNTERS.values()}
    return out
