"""Writes that cannot leak: the write in progress is recorded before it starts.

A service write is several map operations (bpf/maps.h: slots and tables, then frontends,
then the old generation's tables go and its slots are freed). Each step keeps the maps consistent for packets, but a
writer killed between two steps (SIGKILL, OOM, a node reboot of the process) used to
leave what it had written for ever: Maglev chunks no frontend reaches, counted against
the map's capacity. (Backend slots need no repair: a run no frontend names is free by
construction, loader/slots.py.) So before the first write the writer records its
*intent* in the registry (the service ids, the generation it writes, the cluster IPs
whose markers may change); after the last it clears it. The next writer (they take the
writer lock one at a time, loader/lock.py) finds a leftover intent and repairs exactly
those services before doing anything else:

- an add that did not finish is rolled back (its frontends, slots, ranges go): the
  command that added it failed, so the service must not exist;
- a delete that did not finish is finished;
- an update whose frontends were flipped only in part is rolled forward to the new
  generation (each frontend keeps its own kind and flags, takes the new sets' sizes and
  runs);
- then every Maglev chunk of those ids under a generation no frontend names is
  removed, and ranges and affinity of ids no frontend names at all;
- markers of the intent's cluster IPs are made right.

A bulk write (the controller's full sync adds thousands of services) records "bulk";
its repair is :func:`sweep` over everything, which is also `kxlb gc`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .errors import KxlbError
from .layout import C, FAMILIES, Family, MaglevKey, SvcValue, family_of
from .registry import Registry

INTENT = "intent"
MARKER = C["KIND_MARKER"]
CLUSTER_IP = C["KIND_CLUSTER_IP"]
SETS = (C["SET_CLUSTER"], C["SET_LOCAL"])
MAX_INTENT_IDS = 64   # more than this is a bulk write: its repair sweeps everything


@dataclass
class Swept:
    """What a repair or sweep removed or fixed."""

    frontends: int = 0     # deleted (rolled back adds, finished deletes)
    rolled_forward: int = 0
    chunks: int = 0
    ranges: int = 0
    markers: int = 0
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.frontends, self.rolled_forward, self.chunks, self.ranges, self.markers))

    def __str__(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.frontends, "frontends removed"),
                                                (self.rolled_forward, "frontends rolled forward"),
                                                (self.chunks, "orphaned Maglev chunks"),
                                                (self.ranges, "orphaned source ranges"),
                                                (self.markers, "markers fixed")) if n]
        return ", ".join(parts) or "nothing to repair"


class Journal:
    """The intent record of one pin directory's writer (None registry: not journaled,
    as in tests that write maps without a registry)."""

    def __init__(self, reg: Registry | None):
        self.reg = reg if reg is not None and reg.fd >= 0 else None

    @contextmanager
    def intent(self, op: str, ids: Iterable[int], vips: Iterable[str] = (), gen: int | None = None,
               ranges_gone: Iterable[str] = ()) -> Iterator[None]:
        """Record ``op`` ("add", "update", "delete" or "bulk") on service ids ``ids``
        for the duration of the block (an update: ``gen`` the generation it writes,
        ``ranges_gone`` the source ranges it removes, which a repair removes too: an
        update cut short never leaves a service admitting more sources than either its
        old or its new ranges). A KxlbError raised inside means the writer rolled
        back itself: the record goes. Anything else (a bug, a kill) leaves it for the
        next writer."""
        if self.reg is None:
            yield
            return
        ids = sorted(set(ids))
        doc: dict = {"op": op, "ids": ids, "vips": sorted(set(vips)), "gen": gen, "ranges_gone": sorted(ranges_gone)}
        if op == "bulk" or len(ids) > MAX_INTENT_IDS:
            doc = {"op": "bulk"}
        self.reg.put(INTENT, doc)
        try:
            yield
        except KxlbError:
            self.reg.delete(INTENT)
            raise
        self.reg.delete(INTENT)

    def pending(self) -> dict | None:
        return self.reg.get(INTENT) if self.reg is not None else None

    def repair(self, maps) -> Swept | None:
        """Repair what a killed writer left (None: it left nothing)."""
        doc = self.pending()
        if doc is None:
            return None
        if doc.get("op") == "bulk":
            done = sweep(maps)
        else:
            ids = set(doc.get("ids", ()))
            done = sweep(maps, ids, doc.get("op", ""), doc.get("gen"), doc.get("vips", ()))
            for cidr in doc.get("ranges_gone", ()):
                fam = family_of(cidr.split("/")[0])
                done.ranges += sum(fam.map(maps, "src_ranges").delete(range_key(fam, i, cidr)) for i in ids)
        self.reg.delete(INTENT)
        return done


def sweep(maps, ids: set[int] | None = None, op: str = "", gen: int | None = None,
          vips: Iterable[str] = ()) -> Swept:
    """Make the maps hold nothing a killed writer left: over ``ids`` (a repair) or over
    every service id (None: `kxlb gc`, a bulk repair). See the module's docstring."""
    out = Swept()
    for fam in FAMILIES:
        services = fam.map(maps, "services")
        fronts = [(k, v) for k, v in services.items() if v.kind != MARKER]
        mine = [(k, v) for k, v in fronts if ids is None or v.svc_id in ids]
        if op in ("add", "delete"):
            for k, v in mine:
                out.frontends += services.delete(k)
            gone = {bytes(k) for k, _ in mine}
            fronts = [(k, v) for k, v in fronts if bytes(k) not in gone]
            mine = []
        elif op == "update" and gen is not None:
            out.rolled_forward += _roll_forward(services, mine, gen)
            mine = [(k, services.get(k) or v) for k, v in mine]
        live_ids = {v.svc_id for k, v in fronts}
        ranges = fam.map(maps, "src_ranges")
        # (the service CIDRs' entries belong to no service: ServiceTable.set_config's)
        out.ranges += _delete_where(ranges, lambda k: k.svc_id not in live_ids and k.svc_id != C["SVC_CIDR_ID"] and
                                    (ids is None or k.svc_id in ids))
        affinity = fam.map(maps, "affinity")
        _delete_where(affinity, lambda k: k.svc_id not in live_ids and (ids is None or k.svc_id in ids))
        out.markers += _fix_markers(services, fronts, None if ids is None else set(vips), fam)
    out.chunks += _sweep_maglev(maps, ids)
    return out


def range_key(fam: Family, svc_id: int, cidr: str):
    """src_range_map's key of one loadBalancerSourceRange (maps.h: prefixlen counts svc_id's 32 bits)."""
    net = fam.parse_net(cidr, "source range")
    return fam.SrcRangeKey(prefixlen=32 + net.prefixlen, svc_id=svc_id, addr=fam.addr_c(str(net.network_address)))


def _roll_forward(services, mine: list, gen: int) -> int:
    """Frontends of one update still on the old generation take the new one's sets (the
    new slots are complete: they were written before any frontend flipped)."""
    flipped = [v for _, v in mine if v.gen == gen]
    if not flipped:
        return 0  # nothing flipped yet: the old generation stays, the new slots go
    new = flipped[0]
    n = 0
    for k, v in mine:
        if v.gen != gen:
            fixed = SvcValue.from_buffer_copy(v)
            fixed.count, fixed.local_count, fixed.gen = new.count, new.local_count, gen
            fixed.table_size, fixed.local_table_size = new.table_size, new.local_table_size
            fixed.slots, fixed.local_slots = new.slots, new.local_slots
            services.put(k, fixed)
            n += 1
    return n


def _delete_where(m, pred) -> int:
    doomed = [k for k in m.keys() if pred(k)]
    return sum(m.delete(k) for k in doomed)


def _probe_delete(m, key_of, n: int) -> int:
    """Delete keys key_of(i, set) for i < n in both sets, probed one by one."""
    return sum(m.delete(key_of(i, s)) for s in SETS for i in range(n))


def _sweep_maglev(maps, ids: set[int] | None) -> int:
    """Maglev chunks (shared by both families) of generations no frontend names."""
    referenced = set()
    for fam in FAMILIES:
        referenced |= {(v.svc_id, v.gen) for _, v in fam.map(maps, "services").items() if v.kind != MARKER}
    if ids is None:
        return _delete_where(maps.maglev, lambda k: (k.svc_id, k.gen) not in referenced)
    from . import maglev
    n = maglev.n_chunks(maglev.MAX_TABLE)
    return sum(_probe_delete(maps.maglev, lambda c, s: MaglevKey(svc_id=i, chunk=c, gen=g, set=s), n)
               for i in ids for g in (0, 1) if (i, g) not in referenced)


def _fix_markers(services, fronts: list, vips: set[str] | None, fam) -> int:
    """A cluster IP has a marker exactly while a service port has it as its cluster IP."""
    users = {fam.c_addr(k.vip) for k, v in fronts if v.kind == CLUSTER_IP}
    n = 0
    markers = {fam.c_addr(k.vip): k for k, v in services.items() if v.kind == MARKER}
    for vip in (set(markers) | users) if vips is None else {v for v in vips if family_of(v) is fam}:
        if vip in users and vip not in markers:
            services.put(fam.SvcKey(vip=fam.addr_c(vip)), SvcValue(kind=MARKER))
            n += 1
        elif vip not in users and vip in markers:
            n += services.delete(markers[vip])
    return n
