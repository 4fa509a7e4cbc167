"""`kxlb cleanup` (and `kxlb controller --cleanup`, as kube-proxy's --cleanup): remove
every program, hook and pin kxlb made on this node, so the node can go back to
kube-proxy.

`unload` removes what the registry records. Cleanup does that, and then looks for kxlb
by name where a record may be missing (a kxlb 0.1 DaemonSet kept its record in the pod's
/run, which went with the pod): tc filters named kxlb_tc / kxlb_tc_egress at kxlb's
priority on every interface of the network namespace, XDP programs named kxlb_xdp, the
socket hooks (kxlb_connect4, ...) on the cgroup, and the pins of kxlb's names in the pin
directory. Nothing else is touched: another tool's filters, programs and pins stay.
"""
from __future__ import annotations

import os

from . import attach
from .datapath import Unloaded, remove_pins, unload
from .errors import KxlbError
from .lock import WriterLock
from .mounts import cgroup2_dir, cgroup2_root
from .registry import Attachment


def _ours_on(ipr, link, ns: str | None) -> list[Attachment]:
    iface, idx = link.get_attr("IFLA_IFNAME"), link["index"]
    found = []
    for parent in (attach.TC_PARENT_INGRESS, attach.TC_PARENT_EGRESS):
        for f in ipr.get_filters(idx, parent=parent):
            opts = f.get_attr("TCA_OPTIONS")
            if opts and opts.get_attr("TCA_BPF_NAME") in (attach.TC_NAME, attach.TC_EGRESS_NAME):
                found = [Attachment(iface=iface, netns=ns, hook="tc")]
    for mode, pid in attach._xdp_progs(ipr, idx).items():
        ref = attach.prog_ref_by_id(pid)
        if ref is not None and ref.name == attach.XDP_PROG_NAME:
            found.append(Attachment(iface=iface, netns=ns, hook="xdp", mode=mode, prog_id=ref.id,
                                    prog_tag=ref.tag, prog_name=ref.name))
    return found


def by_name(ns: str | None) -> list[Attachment]:
    """kxlb's tc filters and XDP programs on the interfaces of ``ns``, found by name."""
    from pyroute2 import IPRoute

    from .netns import netns

    found = []
    with netns(ns):
        ipr = IPRoute()
    try:
        for link in ipr.get_links():
            try:
                found += _ours_on(ipr, link, ns)
            except Exception as exc:  # pyroute2's NetlinkError: a pod's veth gone since the listing
                if not attach.device_gone(exc):
                    raise
    finally:
        ipr.close()
    return found


def cleanup(pin_dir: str, ns: str | None = None, cgroup: str | None = None, wait: float = 0.0) -> Unloaded:
    """Remove kxlb from this node: recorded attachments and pins, then what is found by
    name in ``ns`` and on ``cgroup`` (default: the cgroup2 root; a v1 hybrid layout's
    /sys/fs/cgroup means its unified/, as for the controller). Idempotent."""
    if cgroup and os.path.isdir(cgroup):
        try:
            cgroup = cgroup2_dir(cgroup)
        except KxlbError:
            pass   # no cgroup v2 there: nothing of ours can be attached to it (_by_name finds none)
    if not os.path.isdir(pin_dir):
        return _by_name(Unloaded(), ns, cgroup)
    with WriterLock(pin_dir).acquire(wait):
        out = unload(pin_dir, wait=wait)
        out.notes = [n for n in out.notes if "has no kxlb registry" not in n]
        _by_name(out, ns, cgroup)
        if os.path.isdir(pin_dir):  # no registry (kxlb 0.1 in a pod): its pins by their names
            removed, notes = remove_pins(pin_dir)
            out.pins_removed += removed
            out.notes += notes
    return out


def _by_name(out: Unloaded, ns: str | None, cgroup: str | None) -> Unloaded:
    from .datapath import _detach
    from .socklb import detach_socket_lb

    for a in by_name(ns):
        note = _detach(a, missing_ok=True)
        out.detached.append(a)
        if note:
            out.notes.append(note)
    where = cgroup or cgroup2_root()
    if where and os.path.isdir(where):
        try:
            if detach_socket_lb(where):
                out.detached.append(Attachment(iface=where, netns=None, hook="socklb"))
        except KxlbError as exc:
            out.notes.append(str(exc))
    return out
