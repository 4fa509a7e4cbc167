"""One source of truth: every map struct of bpf/maps.h against its ctypes mirror.

clang compiles maps.h for the BPF target with debug info; bpftool dumps the BTF; each
struct's size and each field's name, offset and size must match loader/layout.py.
"""
from __future__ import annotations

import ctypes
import json
import struct
import subprocess

import pytest

from kxlb.loader.layout import BPF_DIR, C, MIRRORS


@pytest.fixture(scope="module")
def btf(tmp_path_factory):
    d = tmp_path_factory.mktemp("btf")
    src = d / "layout.c"
    src.write_text('#include <linux/types.h>\n#include "maps.h"\n' +
                   "".join(f"struct {name} v_{name};\n" for name in MIRRORS))
    obj = d / "layout.o"
    subprocess.run(["clang", "-target", "bpf", "-g", "-O0", "-c", f"-I{BPF_DIR}",
                    "-I/usr/include/x86_64-linux-gnu", "-o", str(obj), str(src)], check=True)
    dump = json.loads(subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(obj)],
                                     check=True, capture_output=True, text=True).stdout)
    return {t["id"]: t for t in dump["types"]}


def _size(types, type_id):
    t = types[type_id]
    if t["kind"] == "ARRAY":
        return t["nr_elems"] * _size(types, t["type_id"])
    if "size" not in t:  # typedef, const, volatile
        return _size(types, t["type_id"])
    return t["size"]


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_struct_matches_its_python_mirror(btf, name):
    mirror = MIRRORS[name]
    c_struct = next(t for t in btf.values() if t.get("kind") == "STRUCT" and t.get("name") == name)
    assert c_struct["size"] == ctypes.sizeof(mirror)
    c_fields = [(m["name"], m["bits_offset"] // 8, _size(btf, m["type_id"])) for m in c_struct["members"]]
    py_fields = [(f, getattr(mirror, f).offset, getattr(mirror, f).size) for f, _ in mirror._fields_]
    assert c_fields == py_fields


def test_every_map_struct_has_a_mirror(btf):
    c_structs = {t["name"] for t in btf.values() if t.get("kind") == "STRUCT"}
    assert c_structs == set(MIRRORS)


def test_constants_come_from_the_header():
    text = (BPF_DIR / "consts.h").read_text()
    assert f"KXLB_CT_TCP_EST_S        {C['CT_TCP_EST_S']}" in text
    assert C["ST_MAX"] > max(v for k, v in C.items() if k.startswith("ST_") and k != "ST_MAX")


@pytest.mark.parametrize("vip, backend", [("10.96.0.10", "10.1.2.3"), ("fd00:96::10", "fd00:244:1::3")],
                         ids=["ipv4", "ipv6"])
def test_bulk_packing_matches_the_ctypes_mirrors(vip, backend):
    """loader/services.py packs bulk writes with struct: same bytes as the mirrors, for
    each family's structs."""
    import socket
    from kxlb.loader import services as sv
    from kxlb.loader.layout import Backend, MaglevKey, ServiceKey, SvcValue, family_of

    fam = family_of(vip)
    b, k = Backend(backend, 8080), ServiceKey(vip, 53, 17)
    raw_b, raw_vip = socket.inet_pton(fam.af, backend), socket.inet_pton(fam.af, vip)
    assert fam.backend.pack(raw_b, (8080).to_bytes(2, "big"), 0) == bytes(b.to_c())
    assert fam.backend.pack(raw_b, (8080).to_bytes(2, "big"), 0x1234) == bytes(
        fam.BackendValue(addr=fam.addr_c(backend), port=b.to_c().port, tag=0x1234))
    assert fam.backend.size == ctypes.sizeof(fam.BackendValue)
    assert fam.svc_key.pack(raw_vip, (53).to_bytes(2, "big"), 17, 0) == bytes(k.to_c())
    assert sv._svc_key(k) == bytes(k.to_c())
    assert ServiceKey.from_c(k.to_c()) == k and Backend.from_c(b.to_c()) == b
    assert sv._SVC_VALUE.pack(9, 4, 2, 1, 3, 0x0102, 600, 251, 1021, 70000, 5) == bytes(
        SvcValue(svc_id=9, count=4, local_count=2, gen=1, kind=3, flags=0x0102, affinity_s=600, table_size=251,
                 local_table_size=1021, slots=70000, local_slots=5))
    # the (chunk, gen, set) tails joined with the svc_id: Maglev keys
    assert sv._keys(struct.pack("=I", 7), 1, 1, 35)[-8:] == bytes(MaglevKey(svc_id=7, chunk=34, gen=1, set=1))
    assert sv._keys(struct.pack("=I", 7), 0, 0, 4)[:8] == bytes(MaglevKey(svc_id=7, chunk=0, gen=0, set=0))


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_a_full_syncs_packed_tables_are_the_maglev_modules_tables(family):
    """add_many fills Maglev tables from the packed slot values (their first bytes are
    the backend's identity), not from Backend objects: the same tables."""
    from kxlb.loader import maglev
    from kxlb.loader import services as sv
    from kxlb.loader.layout import Backend, ServiceKey
    from kxlb.loader.svcspec import LbService

    assert all(bytes(b.to_c())[:b.family.ident_len] == maglev.identity(b)
               for b in (Backend("10.1.2.3", 8080), Backend("192.168.255.1", 1), Backend("fd00::1:2", 443)))
    if family == "ipv6":
        cluster = tuple(Backend(f"fd00:2::{i:x}", 8000 + i) for i in range(300))
        key = ServiceKey("fd00:96::1", 80, 6)
    else:
        cluster = tuple(Backend(f"10.2.{i // 200}.{i % 200}", 8000 + i) for i in range(300))
        key = ServiceKey("10.96.0.1", 80, 6)
    local = cluster[:2]
    spec = LbService(key=key, cluster=cluster, local=local)
    m = (maglev.table_size(len(cluster)), maglev.table_size(len(local)))
    slot_keys, slot_vals, table_keys, table_vals, n = sv._pack_slots(9, 1, spec, m, (1000, 77))
    tag = sv.slot_tag(9, 1)
    assert tag == 0x8000 | 19 and sv.slot_tag(1 << 15, 0) == 0x8000   # never 0: a slot never written
    want = []
    for b in cluster + local:
        c = b.to_c()
        c.tag = tag
        want.append(bytes(c))
    assert slot_vals == b"".join(want)
    assert slot_keys == struct.pack(f"={len(cluster) + len(local)}I", *range(1000, 1000 + len(cluster)), 77, 78)
    assert n == maglev.n_chunks(m[0]) + maglev.n_chunks(m[1]) and len(table_keys) == 8 * n
    assert table_vals == b"".join(maglev.chunks(cluster, m[0]) + maglev.chunks(local, m[1]))


# --- pinned maps: what the kernel holds is what loader/mapspec.py reads from bpf/ ------------------
def test_every_pinned_map_matches_its_spec(dp, pin_dirs):
    """The loader judges pins against the specs before BCC adopts them (loader/datapath.py
    plan): type, key and value sizes, capacity and flags must be what BCC creates."""
    import os

    from kxlb.loader import bpfsys
    from kxlb.loader.mapspec import datapath_specs
    from kxlb.loader.socklb import compile_sock

    _, maps = dp
    compile_sock(maps.pin_dir)  # the socket hooks' maps (sock_rev, sock_rev6) come from sock.c's build
    specs = datapath_specs()
    assert {"services_v2", "backends_v2", "conntrack_v2", "masq_ports", "sock_rev", "tc_progs"} <= set(specs)
    for pin, spec in specs.items():
        fd = bpfsys.obj_get(os.path.join(maps.pin_dir, pin))
        try:
            assert spec.mismatch(bpfsys.map_info(fd)) is None, pin
        finally:
            os.close(fd)


def test_every_layout_is_released_under_its_version():
    """A struct of a pinned map that changes without a new layout version (a new pin
    name, bpf/layouts.txt) would be adopted by the next release as if nothing changed."""
    from kxlb.loader.mapspec import datapath_specs, released_layouts

    released = released_layouts()
    for spec in datapath_specs().values():
        if spec.stateful:
            assert released.get((spec.base, spec.version)) == spec.digest, (
                f"map {spec.base}: its key/value layout changed; rename its pin to "
                f"{spec.base}_v{spec.version + 1}, add a line to bpf/layouts.txt and a converter (loader/migrate.py)")


def test_every_older_layout_can_be_migrated():
    from kxlb.loader import migrate
    from kxlb.loader.mapspec import datapath_specs, released_layouts

    current = {s.base: s.version for s in datapath_specs().values() if s.stateful}
    for base, version in released_layouts():
        assert base in current, f"{base}: released, but this build has no such map (a migration must drop it)"
        if version < current[base] and base not in migrate.DISPOSABLE:
            assert migrate.path(base, version, current[base]) is not None, f"{base} {version} -> {current[base]}"
