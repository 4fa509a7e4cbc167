"""kxlb's own records, kept in the pin directory beside the maps they describe.

bpffs holds BPF objects only, so the records are a pinned hash map of small JSON
documents (``registry``): where the datapath is attached (tc, XDP, socket hooks), which
process writes the maps now (the writer lock's holder), the write in progress (so one
killed half way is repaired by the next writer: loader/journal.py) and what the pinned
programs were compiled from (a restart with the same build attaches them without
compiling again).

Why on bpffs and not in /run: the records must live exactly as long as the datapath.
A DaemonSet's /run goes with its pod, and then nothing knew where the programs were
attached (an uninstall left them translating). The pin directory survives the pod,
and goes with `kxlb unload`/`kxlb cleanup`, records included.

Each document is one map element: a hash map update swaps an element whole (no
preallocation, so a reader never sees a half-written document), so every record is
written atomically. Only the writer lock's holder writes.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields

from . import bpfsys
from .errors import KxlbError

REGISTRY_PIN = "registry"
KEY_SIZE, VALUE_SIZE, MAX_RECORDS = 64, 4096, 1024
LEGACY_DIR = "/run/kxlb"   # where kxlb 0.1 kept its attachment records (a JSON file per pin dir)


class _Key(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * KEY_SIZE)]


class _Doc(ctypes.Structure):
    _fields_ = [("length", ctypes.c_uint32), ("text", ctypes.c_char * (VALUE_SIZE - 4))]


@dataclass(frozen=True)
class Attachment:
    iface: str
    netns: str | None   # None: the loader's own namespace
    hook: str           # "tc", "xdp", or "socklb" (iface is then a cgroup directory)
    mode: str = ""      # xdp: "generic" or "native"
    prog_id: int = 0    # xdp: the program we attached (0: recorded by an older kxlb)
    prog_tag: str = ""
    prog_name: str = ""

    @property
    def record(self) -> str:
        """Its record's name: one per interface (tc or XDP) and one per cgroup."""
        where = f"socklb {self.iface}" if self.hook == "socklb" else f"if {self.netns or ''} {self.iface}"
        return "att/" + hashlib.sha256(where.encode()).hexdigest()[:32]

    @classmethod
    def from_doc(cls, doc: dict) -> "Attachment":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


class Registry:
    """The records of one pin directory. Opening creates the map only with ``create``
    (a writer, holding the writer lock); readers of a directory without one see no
    records."""

    def __init__(self, pin_dir: str, create: bool = False):
        self.pin_dir = os.path.abspath(pin_dir)
        self.path = os.path.join(self.pin_dir, REGISTRY_PIN)
        self.fd = -1
        try:
            self.fd = bpfsys.obj_get(self.path)
        except OSError:
            if create:
                self.fd = self._create()
        if self.fd >= 0:
            info = bpfsys.map_info(self.fd)
            if (info.key_size, info.value_size, info.name) != (KEY_SIZE, VALUE_SIZE, b"kxlb_registry"):
                os.close(self.fd)
                raise KxlbError(f"{self.path} is not a kxlb registry (key/value sizes {info.key_size}/"
                                f"{info.value_size}): remove it, or choose another --pin-dir")
            if create:
                self._import_legacy()

    def _create(self) -> int:
        fd = bpfsys.map_create(bpfsys.BPF_MAP_TYPE_HASH, "kxlb_registry", KEY_SIZE, VALUE_SIZE, MAX_RECORDS,
                               bpfsys.BPF_F_NO_PREALLOC)
        try:
            bpfsys.obj_pin(fd, self.path)
        except OSError as exc:
            os.close(fd)
            raise KxlbError(f"cannot pin the registry at {self.path}: {exc.strerror}") from None
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- documents -----------------------------------------------------------------------
    def get(self, name: str) -> dict | None:
        if self.fd < 0:
            return None
        doc = _Doc()
        if bpfsys.lib().bpf_map_lookup_elem(self.fd, ctypes.byref(_Key(name.encode())), ctypes.byref(doc)) < 0:
            return None
        return json.loads(doc.text[:doc.length].decode())

    def put(self, name: str, doc: dict) -> None:
        if self.fd < 0:
            raise KxlbError(f"no registry in {self.pin_dir}")
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        if len(raw) > VALUE_SIZE - 4:
            raise KxlbError(f"registry record {name!r} is {len(raw)} bytes, at most {VALUE_SIZE - 4} fit")
        bpfsys.check(bpfsys.lib().bpf_map_update_elem(self.fd, ctypes.byref(_Key(name.encode())),
                                                      ctypes.byref(_Doc(len(raw), raw)), bpfsys.BPF_ANY),
                     f"write registry record {name!r} in {self.path}")

    def delete(self, name: str) -> None:
        if self.fd >= 0:
            bpfsys.lib().bpf_map_delete_elem(self.fd, ctypes.byref(_Key(name.encode())))

    def names(self, prefix: str = "") -> list[str]:
        if self.fd < 0:
            return []
        out, prev, nxt = [], None, _Key()
        while bpfsys.lib().bpf_map_get_next_key(self.fd, ctypes.byref(prev) if prev is not None else None,
                                                ctypes.byref(nxt)) >= 0:
            name = nxt.name.decode()
            if name.startswith(prefix):
                out.append(name)
            prev = _Key.from_buffer_copy(nxt)
        return sorted(out)

    # --- attachments ---------------------------------------------------------------------
    def attachments(self) -> list[Attachment]:
        out = []
        for name in self.names("att/"):
            doc = self.get(name)
            if doc is not None:
                out.append(Attachment.from_doc(doc))
        return out

    def find(self, iface: str, ns: str | None) -> Attachment | None:
        """The tc or XDP attachment recorded on an interface."""
        return next((a for a in self.attachments() if (a.iface, a.netns) == (iface, ns) and a.hook != "socklb"), None)

    def record(self, a: Attachment) -> None:
        self.put(a.record, asdict(a))

    def forget(self, a: Attachment) -> None:
        self.delete(a.record)

    # --- kxlb 0.1's records ---------------------------------------------------------------
    def _import_legacy(self) -> None:
        """Take over the attachment records kxlb 0.1 kept in /run/kxlb, so an upgraded
        node still knows where its datapath is attached."""
        path = legacy_path(self.pin_dir)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return
        items = doc if isinstance(doc, list) else doc.get("attachments", [])
        for item in items:
            self.record(Attachment.from_doc(item))
        os.unlink(path)


def legacy_path(pin_dir: str) -> str:
    """kxlb 0.1's record file of a pin directory (one per directory: '/a_b' and '/a/b' differ)."""
    path = os.path.abspath(pin_dir).strip("/")
    slug = path.replace("%", "%25").replace("_", "%5F").replace("/", "_") or "root"
    return os.path.join(LEGACY_DIR, f"{slug}.json")
