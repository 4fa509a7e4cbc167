"""What the datapath pins, read from its own declarations, and the layout version of each.

Every ``BPF_TABLE_PINNED(...)`` line of bpf/ declares a map: its type, key and value
structs, capacity and pin name. This module reads those lines (one source of truth: the
C the kernel runs) and gives each pinned map a :class:`MapSpec` with everything the
kernel reports about a map (type, key size, value size, capacity, flags), so the loader
can tell, *before* BCC adopts a pin, whether the pin is of this build's layout.

Layout versions. A pinned map carries its layout version in its pin name: ``services`` is
version 1, ``conntrack_v2`` version 2 (Cilium names its maps the same way). A change to a
map's key or value struct must bump the version (rename the pin in the declaration), so a
release never adopts a map of another layout under the same name, and an older release,
which only knows the older name, never adopts the newer map either. ``bpf/layouts.txt``
records the digest of every released layout; tests/test_layout.py fails when a struct
changes without a new version. Migrations between versions live in loader/migrate.py.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import KxlbError
from .layout import BPF_DIR, C, MIRRORS

# bpf_map_type numbers (uapi/linux/bpf.h) of the map types the datapath uses, by BCC's names.
MAP_TYPES = {"hash": 1, "array": 2, "prog": 3, "percpu_array": 6, "lru_hash": 9, "lpm_trie": 11,
             "array_of_maps": 12}
MAP_FLAGS = {"BPF_F_NO_PREALLOC": 1}
_SCALARS = {"__u8": ctypes.c_uint8, "__u16": ctypes.c_uint16, "__u32": ctypes.c_uint32, "__u64": ctypes.c_uint64}

_DECL = re.compile(
    r'BPF_TABLE_PINNED\(\s*"(?P<type>\w+)(?:\$(?P<inner>\w+))?"\s*,\s*(?P<key>[\w ]+?)\s*,\s*(?P<value>[\w ]+?)\s*,'
    r'\s*(?P<var>\w+)\s*,\s*(?P<cap>\w+)\s*,\s*KXLB_PIN_DIR\s*"/(?P<pin>\w+)"\s*(?:,\s*(?P<flags>\w+)\s*)?\)\s*;')
_INNER = r'BPF_TABLE\(\s*"\w+"\s*,\s*[\w ]+?\s*,\s*(?P<value>[\w ]+?)\s*,\s*{}\s*,'
_VERSIONED = re.compile(r"^(?P<base>\w+?)_v(?P<version>\d+)$")
SOURCES = ("maps.h", "kxlb.c")  # sock.c includes maps.h: its maps are maps.h's

LAYOUTS_FILE = BPF_DIR / "layouts.txt"


def split_pin(pin: str) -> tuple[str, int]:
    """``conntrack_v2`` -> ("conntrack", 2); ``services`` -> ("services", 1)."""
    m = _VERSIONED.match(pin)
    return (m.group("base"), int(m.group("version"))) if m else (pin, 1)


def pin_name(base: str, version: int) -> str:
    return base if version == 1 else f"{base}_v{version}"


def _ctype(text: str):
    text = text.strip()
    if text.startswith("struct "):
        return MIRRORS[text.removeprefix("struct ").strip()]
    return _SCALARS[text]


def layout_digest(*types) -> str:
    """A short digest of ctypes layouts: every field's name, offset and size, nested
    structs and arrays spelled out, so any change to a struct changes it."""
    def walk(t, out: list) -> None:
        if isinstance(t, type) and issubclass(t, ctypes.Structure):
            for name, ft, *_ in t._fields_:
                out.append((name, getattr(t, name).offset, ctypes.sizeof(ft)))
                walk(ft, out)
        elif isinstance(t, type) and issubclass(t, ctypes.Array):
            out.append(("[]", t._length_, ctypes.sizeof(t._type_)))
            walk(t._type_, out)
        else:
            out.append((t.__name__, ctypes.sizeof(t)))
    parts: list = []
    for t in types:
        walk(t, parts)
        parts.append("|")
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MapSpec:
    """One pinned map as this build declares it."""

    pin: str             # the pin's file name in the pin directory (versioned)
    var: str             # the C variable (BCC's map name, truncated by the kernel to 15)
    map_type: int
    key_t: type
    value_t: type
    max_entries: int
    flags: int
    stateful: bool = True  # False: rebuilt by every load (program arrays), never adopted
    inner_t: type | None = None  # a map of maps: the value type of its inner maps

    @property
    def base(self) -> str:
        return split_pin(self.pin)[0]

    @property
    def version(self) -> int:
        return split_pin(self.pin)[1]

    @property
    def key_size(self) -> int:
        return ctypes.sizeof(self.key_t)

    @property
    def value_size(self) -> int:
        return ctypes.sizeof(self.value_t)

    @property
    def digest(self) -> str:
        return layout_digest(self.key_t, self.value_t, *([self.inner_t] if self.inner_t else []))

    def mismatch(self, info) -> str | None:
        """How a map's bpf_map_info differs from this spec (None: it is this layout)."""
        want = (self.map_type, self.key_size, self.value_size, self.max_entries, self.flags)
        got = (info.type, info.key_size, info.value_size, info.max_entries, info.map_flags)
        if want == got:
            return None
        names = ("type", "key size", "value size", "capacity", "flags")
        return ", ".join(f"{n} {g} (this kxlb: {w})" for n, w, g in zip(names, want, got) if w != g)


def capacities(cflags: list[str] | None = None) -> dict[str, int]:
    """consts.h's values with the ``-DKXLB_X=N`` overrides of a build applied."""
    out = dict(C)
    for flag in cflags or ():
        m = re.fullmatch(r"-DKXLB_(\w+)=(\d+)", flag)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def datapath_specs(cflags: list[str] | None = None) -> dict[str, MapSpec]:
    """Every map the datapath pins, by pin name, as declared in bpf/ (for a build with
    ``cflags``)."""
    consts = capacities(cflags)
    out: dict[str, MapSpec] = {}
    for src in SOURCES:
        text = (BPF_DIR / src).read_text()
        for m in _DECL.finditer(text):
            cap = m.group("cap")
            max_entries = int(cap) if cap.isdigit() else consts[cap.removeprefix("KXLB_")]
            flags = MAP_FLAGS[m.group("flags")] if m.group("flags") else 0
            inner = m.group("inner") and re.search(_INNER.format(m.group("inner")), text)
            out[m.group("pin")] = MapSpec(
                pin=m.group("pin"), var=m.group("var"), map_type=MAP_TYPES[m.group("type")],
                key_t=_ctype(m.group("key")), value_t=_ctype(m.group("value")), max_entries=max_entries,
                flags=flags, stateful=m.group("type") != "prog",
                inner_t=_ctype(inner.group("value")) if inner else None)
    if not out:
        raise KxlbError(f"no BPF_TABLE_PINNED declarations found in {BPF_DIR}")
    return out


def conntrack_cflags(flows: int) -> list[str]:
    """Build flags sizing conntrack for ``flows`` tracked flows (kube-proxy users think in
    nf_conntrack_max): one IPv4 record per client socket, which is one flow but for the
    rare socket with several (maps.h ct_entry), socket translations as many; IPv6 a
    quarter of that (its records are 2.2 times the size, and clusters carry less of it).
    The LRU tables are preallocated: memory follows this, not the traffic."""
    from .errors import KxlbError

    if not 1024 <= flows <= 1 << 24:
        raise KxlbError(f"conntrack size {flows}: expected 1024 to {1 << 24} flows")
    return [f"-DKXLB_CT_ENTRIES={flows}", f"-DKXLB_CT6_ENTRIES={max(1024, flows // 4)}"]


def current_pin(base: str) -> str:
    """This build's pin of the map ``base`` (its versioned name: conntrack -> conntrack_v2)."""
    return next((pin for pin, spec in _SPECS.items() if spec.base == base), base)


def released_layouts(path: Path = LAYOUTS_FILE) -> dict[tuple[str, int], str]:
    """(base name, version) -> layout digest of every layout a release shipped."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            base, version, digest = line
            out[(base, int(version))] = digest
    return out


def build_pins(cflags: list[str] | None = None) -> set[str]:
    """Every pin a load of this build leaves in a pin directory: its maps, its programs
    (the datapath's and the socket hooks') and the registry."""
    from .compile import PROG_PINS
    from .registry import REGISTRY_PIN
    from .socklb import PROG_PINS as SOCK_PROG_PINS

    return set(datapath_specs(cflags)) | set(PROG_PINS.values()) | set(SOCK_PROG_PINS.values()) | {REGISTRY_PIN}


def known_pins() -> set[str]:
    """Every pin name any release of kxlb made in a pin directory: this build's maps,
    the older layouts' names, the programs, the registry and the writers' service id
    bitmap. Nothing else in a pin directory is ever removed by kxlb."""
    from .svcids import PIN as SVC_IDS_PIN

    return build_pins() | {SVC_IDS_PIN} | {pin_name(base, v) for base, v in released_layouts()}


_SPECS = datapath_specs()
LAYOUT_VERSION = 1 + sum(split_pin(p)[1] - 1 for p in _SPECS)
"""The datapath's layout generation: 1 plus every version bump of any of its maps, so it
grows with each layout change (what `kxlb version` reports; the maps' own versions are in
their pin names)."""
