"""Attaching the programs to interfaces with pyroute2 (tc clsact ingress, or XDP).

Attachments outlive this process: the kernel's tc filter and XDP link hold the
programs, the pinned maps hold the state. The registry in the pin directory
(loader/registry.py) remembers where we attached (and which XDP program, by id), so
`kxlb unload` can find every place again and remove nothing that is not ours.

Good neighbour rules (docs/datapath.md, "Hooks and coexistence"): an XDP program we did
not attach is never replaced or detached without ``force``; XDP changes name the program
they expect to find (XDP_FLAGS_REPLACE), so a program another tool attached a moment
ago is never clobbered; a failed mode switch puts the previous program back.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from . import bpfsys
from .errors import KxlbError
from .netns import netns
from .registry import Attachment

TC_PARENT_INGRESS = "ffff:fff2"
TC_PRIO = 0x4b1      # our filter's fixed priority and handle: replace, never duplicate
TC_HANDLE = 1
TC_NAME = "kxlb_tc"
XDP_PROG_NAME = "kxlb_xdp"
XDP_FLAGS = {"generic": 2, "native": 4}  # XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE
XDP_FLAGS_UPDATE_IF_NOEXIST = 1   # attach only if the mode has no program (no silent replace)
XDP_FLAGS_REPLACE = 16            # change only if the program there is IFLA_XDP_EXPECTED_FD's
IFF_LOOPBACK = 0x8


@contextmanager
def _ipr(ns: str | None) -> Iterator:
    from pyroute2 import IPRoute

    with netns(ns):
        ipr = IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def _ifindex(ipr, iface: str, ns: str | None) -> int:
    found = ipr.link_lookup(ifname=iface)
    if not found:
        where = f"network namespace {ns!r}" if ns else "this network namespace"
        raise KxlbError(f"interface {iface!r} not found in {where}")
    return found[0]


def interface_exists(ns: str | None, iface: str) -> None:
    """Raise the usual one-line error when ``iface`` is not in the namespace."""
    with _ipr(ns) as ipr:
        _ifindex(ipr, iface, ns)


# Link types whose frames start with an Ethernet header, as the datapath parses them
# (parse.h). A tun, WireGuard or IP-in-IP device hands tc and XDP a bare IP packet (link
# type "none", 65534, or a tunnel's), which the parser would misread as Ethernet.
ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ETHERNET_LINK_TYPES = {ARPHRD_ETHER: "ether", ARPHRD_LOOPBACK: "loopback"}


def require_ethernet(ns: str | None, iface: str) -> None:
    """Refuse, in one line, a device whose frames have no Ethernet header."""
    with _ipr(ns) as ipr:
        link = ipr.get_links(_ifindex(ipr, iface, ns))[0]
    kind = link["ifi_type"]
    if kind not in ETHERNET_LINK_TYPES:
        raise KxlbError(f"interface {iface!r}: link type {kind} is not Ethernet (a tun, WireGuard or "
                        f"IP tunnel device?); kxlb's programs parse Ethernet frames only")


def device_gone(exc: Exception) -> bool:
    """Whether a netlink error (pyroute2's NetlinkError) says the device went away since it
    was named: a pod's veth deleted meanwhile."""
    return getattr(exc, "code", None) in (errno.ENODEV, errno.ENOENT)


def _netlink_error(exc: Exception, what: str) -> KxlbError:
    code = getattr(exc, "code", None)
    hint = " (needs root: CAP_NET_ADMIN and CAP_BPF)" if code in (errno.EPERM, errno.EACCES) else ""
    return KxlbError(f"{what}: {exc}{hint}")


def list_links(ns: str | None) -> list[str]:
    """Names of the interfaces in a network namespace."""
    with _ipr(ns) as ipr:
        return [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]


# --- tc ------------------------------------------------------------------------------------
TC_PARENT_EGRESS = "ffff:fff3"
TC_EGRESS_NAME = "kxlb_tc_egress"
TC_HOOKS = {"ingress": (TC_PARENT_INGRESS, TC_NAME), "egress": (TC_PARENT_EGRESS, TC_EGRESS_NAME)}


def _filter_at_our_place(ipr, idx: int, parent: str) -> str | None:
    """The name of the filter at our priority and handle on one clsact hook, if any (a
    BPF filter's TCA_BPF_NAME; another kind of filter at our priority reads as its kind)."""
    for f in ipr.get_filters(idx, parent=parent):
        kind = f.get_attr("TCA_KIND")
        if kind is None or (f["info"] >> 16) != TC_PRIO:
            continue
        if kind != "bpf":
            return kind
        opts = f.get_attr("TCA_OPTIONS")
        if opts is not None and f["handle"] == TC_HANDLE:
            return opts.get_attr("TCA_BPF_NAME") or ""
    return None


def _foreign_filter_error(iface: str, direction: str, name: str) -> KxlbError:
    return KxlbError(f"{iface}: the tc {direction} filter at priority {TC_PRIO} handle {TC_HANDLE} is another "
                     f"tool's ({name!r}): kxlb does not replace it; remove it (tc filter del dev {iface} "
                     f"{direction} pref {TC_PRIO}) or move that tool to another priority")


def attach_tc(ns: str | None, iface: str, prog_fd: int, direction: str = "ingress") -> None:
    """Our filter on the interface's clsact ``direction``: ingress runs the datapath,
    egress translates the ICMP errors the node itself sends about translated flows.
    Replaces our own filter (an upgrade, a re-load) at its fixed priority and handle; a
    filter another tool put there is refused, not replaced (good neighbour)."""
    parent, name = TC_HOOKS[direction]
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        try:
            ipr.tc("add", "clsact", idx)
        except Exception as exc:  # pyroute2's NetlinkError
            if getattr(exc, "code", None) != errno.EEXIST:
                raise _netlink_error(exc, f"adding clsact qdisc on {iface}") from None
        found = _filter_at_our_place(ipr, idx, parent)
        if found is not None and found != name:
            raise _foreign_filter_error(iface, direction, found)
        try:
            ipr.tc("replace-filter", "bpf", idx, f":{TC_HANDLE}", fd=prog_fd, name=name,
                   parent=parent, classid=1, direct_action=True, prio=TC_PRIO)
        except Exception as exc:
            raise _netlink_error(exc, f"attaching tc {direction} program on {iface}") from None


def detach_tc(ns: str | None, iface: str, directions: tuple[str, ...] = ("ingress", "egress")) -> None:
    """Our filters off the interface (the clsact qdisc too when nothing else is on it); a
    filter another tool put at our priority and handle is left where it is."""
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        for direction in directions:
            found = _filter_at_our_place(ipr, idx, TC_HOOKS[direction][0])
            if found != TC_HOOKS[direction][1]:
                continue   # nothing there, or not ours
            try:
                ipr.tc("del-filter", "bpf", idx, f":{TC_HANDLE}", parent=TC_HOOKS[direction][0], prio=TC_PRIO)
            except Exception as exc:
                if getattr(exc, "code", None) not in (errno.ENOENT, errno.EINVAL):
                    raise _netlink_error(exc, f"detaching tc {direction} program from {iface}") from None
        # Remove the clsact qdisc too, unless someone (or our other direction) still has filters on it.
        others = [f for parent in (TC_PARENT_INGRESS, TC_PARENT_EGRESS)
                  for f in ipr.get_filters(idx, parent=parent) if f.get_attr("TCA_KIND")]
        if not others:
            try:
                ipr.tc("del", "clsact", idx)
            except Exception as exc:
                if getattr(exc, "code", None) not in (errno.ENOENT, errno.EINVAL):
                    raise _netlink_error(exc, f"removing clsact from {iface}") from None


def tc_attached(ns: str | None, iface: str, direction: str = "ingress") -> bool:
    parent, name = TC_HOOKS[direction]
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        for f in ipr.get_filters(idx, parent=parent):
            opts = f.get_attr("TCA_OPTIONS")
            if opts and opts.get_attr("TCA_BPF_NAME") == name:
                return True
        return False


# --- BPF program identity ------------------------------------------------------------------
class _ProgInfo(ctypes.Structure):
    """Leading fields of the kernel's struct bpf_prog_info (the rest stays zero)."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
                ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16),
                ("_rest", ctypes.c_uint8 * 160)]


@dataclass(frozen=True)
class ProgRef:
    id: int
    tag: str
    name: str

    def __str__(self) -> str:
        return f"id {self.id}, name {self.name!r}, tag {self.tag}"


def prog_ref(fd: int) -> ProgRef:
    info = _ProgInfo()
    size = ctypes.c_uint32(ctypes.sizeof(info))
    bpfsys.check(bpfsys.lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)), "program info")
    return ProgRef(info.id, bytes(info.tag).hex(), info.name.decode(errors="replace"))


def _prog_fd_by_id(prog_id: int) -> int:
    """A file descriptor of the loaded program ``prog_id`` (OSError ENOENT if it is gone)."""
    f = bpfsys.lib().bpf_prog_get_fd_by_id
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_uint32]
    return bpfsys.check(f(prog_id), f"open BPF program id {prog_id}")


def prog_ref_by_id(prog_id: int) -> ProgRef | None:
    try:
        fd = _prog_fd_by_id(prog_id)
    except OSError:
        return None
    try:
        return prog_ref(fd)
    finally:
        os.close(fd)


def is_ours(prog_id: int, recorded: Attachment | None) -> bool:
    """Is the XDP program ``prog_id`` the one we recorded for this interface? An id alone
    could in theory be reused after our program went away, so its name and tag must match
    too. A record without an id (an older kxlb) falls back to the program's name."""
    if not prog_id or recorded is None or recorded.hook != "xdp":
        return False
    ref = prog_ref_by_id(prog_id)
    if ref is None:
        return False
    if recorded.prog_id:
        return (ref.id, ref.tag, ref.name) == (recorded.prog_id, recorded.prog_tag, recorded.prog_name)
    return ref.name == XDP_PROG_NAME


# --- XDP -----------------------------------------------------------------------------------
def _xdp_progs(ipr, idx: int) -> dict[str, int]:
    """Mode -> id of the XDP program attached in that mode (offloaded ones ignored)."""
    xdp = ipr.get_links(idx)[0].get_attr("IFLA_XDP")
    if not xdp:
        return {}
    found = {"generic": xdp.get_attr("IFLA_XDP_SKB_PROG_ID"), "native": xdp.get_attr("IFLA_XDP_DRV_PROG_ID")}
    attached = {"xdpgeneric": "generic", "xdp": "native"}.get(xdp.get_attr("IFLA_XDP_ATTACHED"))
    if attached and not found[attached]:  # older kernels report only IFLA_XDP_PROG_ID for one mode
        found[attached] = xdp.get_attr("IFLA_XDP_PROG_ID")
    return {mode: pid for mode, pid in found.items() if pid}


def xdp_programs(ns: str | None, iface: str) -> dict[str, int]:
    """Mode ('generic'/'native') -> program id of what is attached at XDP on ``iface``."""
    with _ipr(ns) as ipr:
        return _xdp_progs(ipr, _ifindex(ipr, iface, ns))


def _set_xdp(ipr, idx: int, fd: int, flags: int, iface: str, expected_fd: int | None = None) -> None:
    attrs = [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags | (XDP_FLAGS_REPLACE if expected_fd is not None else 0))]
    if expected_fd is not None:
        attrs.append(("IFLA_XDP_EXPECTED_FD", expected_fd))
    try:
        ipr.link("set", index=idx, xdp={"attrs": attrs})
    except Exception as exc:
        what = "detaching the XDP program from" if fd < 0 else "attaching XDP program on"
        raise _netlink_error(exc, f"{what} {iface}") from None


def _foreign_error(iface: str, mode: str, prog_id: int) -> KxlbError:
    ref = prog_ref_by_id(prog_id)
    return KxlbError(f"interface {iface} already has an XDP program kxlb did not attach ({mode} mode, "
                     f"{ref or f'id {prog_id}'}): kxlb does not replace it; detach it first "
                     f"(ip link set dev {iface} xdp off), use tc (load without --xdp), or pass --force")


def attach_xdp(ns: str | None, iface: str, prog_fd: int, mode: str,
               recorded: Attachment | None = None, force: bool = False) -> ProgRef:
    """Attach ``prog_fd`` at XDP in ``mode``. A program already there must be the one
    ``recorded`` for this interface (ours), unless ``force``. Switching mode needs the old
    program gone first (the kernel refuses generic and native at once): if the new mode
    then fails (a driver without native XDP), the old program is attached again."""
    new = prog_ref(prog_fd)
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        current = _xdp_progs(ipr, idx)
        for m, pid in current.items():
            if pid != new.id and not is_ours(pid, recorded) and not force:
                raise _foreign_error(iface, m, pid)
        if current == {mode: new.id}:
            return new
        if mode in current:
            _with_prog(current[mode], lambda old_fd: _set_xdp(ipr, idx, prog_fd, XDP_FLAGS[mode], iface, old_fd))
            return new
        if not current:
            _set_xdp(ipr, idx, prog_fd, XDP_FLAGS[mode] | XDP_FLAGS_UPDATE_IF_NOEXIST, iface)
            return new
        (old_mode, old_id), = current.items()
        old_fd = _prog_fd_by_id_or_error(old_id, iface)
        try:
            _set_xdp(ipr, idx, -1, XDP_FLAGS[old_mode], iface, old_fd)
            try:
                _set_xdp(ipr, idx, prog_fd, XDP_FLAGS[mode] | XDP_FLAGS_UPDATE_IF_NOEXIST, iface)
            except KxlbError as exc:
                try:
                    _set_xdp(ipr, idx, old_fd, XDP_FLAGS[old_mode] | XDP_FLAGS_UPDATE_IF_NOEXIST, iface)
                except KxlbError as again:
                    raise KxlbError(f"{exc}; putting back the {old_mode} XDP program (id {old_id}) failed too: "
                                    f"{again}") from None
                raise KxlbError(f"{exc}; the {old_mode} XDP program that was there (id {old_id}) is attached "
                                f"again") from None
        finally:
            os.close(old_fd)
        return new


def _prog_fd_by_id_or_error(prog_id: int, iface: str) -> int:
    try:
        return _prog_fd_by_id(prog_id)
    except OSError as exc:  # detached and freed between our look and now
        raise KxlbError(f"the XDP program on {iface} changed while kxlb looked at it (id {prog_id}: "
                        f"{exc.strerror}); try again") from None


def _with_prog(prog_id: int, fn) -> None:
    fd = _prog_fd_by_id_or_error(prog_id, "the interface")
    try:
        fn(fd)
    finally:
        os.close(fd)


def detach_xdp(ns: str | None, iface: str, recorded: Attachment | None) -> ProgRef | None:
    """Detach the XDP program ``recorded`` as ours on ``iface``, if it is still the one
    attached. Returns the program left attached when it is someone else's (None when
    nothing of anyone's is left)."""
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        left = None
        for mode, pid in _xdp_progs(ipr, idx).items():
            if not is_ours(pid, recorded):
                left = prog_ref_by_id(pid) or ProgRef(pid, "", "")
                continue
            try:
                # REPLACE with the expected program: if someone swapped it in the meantime,
                # the kernel refuses (EEXIST) and theirs stays.
                _with_prog(pid, lambda fd: _set_xdp(ipr, idx, -1, XDP_FLAGS[mode], iface, fd))
            except KxlbError:
                left = prog_ref_by_id(pid)
        return left


def xdp_attached(ns: str | None, iface: str) -> str | None:
    """'generic', 'native' or None."""
    progs = xdp_programs(ns, iface)
    return next(iter(progs), None)


# --- where XDP is correct ------------------------------------------------------------------
SIOCETHTOOL, ETHTOOL_GDRVINFO = 0x8946, 3


def ethtool_driver(ns: str | None, iface: str) -> str:
    """The driver name ethtool reports for ``iface`` ('' if the device has none)."""
    drvinfo = ctypes.create_string_buffer(196)        # struct ethtool_drvinfo
    ctypes.memmove(drvinfo, ctypes.byref(ctypes.c_uint32(ETHTOOL_GDRVINFO)), 4)
    ifreq = bytearray(40)                              # struct ifreq: name, then a pointer
    ifreq[:len(iface)] = iface.encode()
    ifreq[16:24] = ctypes.addressof(drvinfo).to_bytes(8, "little")
    with netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
    except OSError:
        return ""
    finally:
        s.close()
    return drvinfo.raw[4:36].split(b"\0", 1)[0].decode(errors="replace")


PARTIAL_CSUM_WHY = (
    "packets from sockets on this host, or from a peer with TX checksum offload on, can reach the "
    "program as CHECKSUM_PARTIAL: their TCP/UDP checksum field holds only the pseudo-header seed, "
    "which XDP's incremental update cannot adjust (it corrupts it, and the ports are not in it), so "
    "once a hop finalises the sum the backend drops the packets (TcpInCsumErrors)")


def xdp_checksum_hazard(ns: str | None, iface: str, mode: str) -> str | None:
    """Why XDP on ``iface`` may be handed CHECKSUM_PARTIAL packets, or None when frames can
    only come from a wire (a physical NIC, or a bond/team of them)."""
    with _ipr(ns) as ipr:
        link = ipr.get_links(_ifindex(ipr, iface, ns))[0]
        return _hazard(ipr, link, ns, mode, 0)


def _hazard(ipr, link, ns: str | None, mode: str, depth: int) -> str | None:
    name = link.get_attr("IFLA_IFNAME")
    if link["flags"] & IFF_LOOPBACK:
        return f"{name} is the loopback device"
    info = link.get_attr("IFLA_LINKINFO")
    kind = info.get_attr("IFLA_INFO_KIND") if info else None
    if kind in ("bond", "team") and depth < 4:  # only as safe as the devices under it
        slaves = [s for s in ipr.get_links() if s.get_attr("IFLA_MASTER") == link["index"]]
        for s in slaves:
            why = _hazard(ipr, s, ns, mode, depth + 1)
            if why:
                return f"{name} aggregates {why}"
        return None
    if kind:
        return f"{name} is a virtual device (a {kind})"
    driver = ethtool_driver(ns, name)
    if driver == "virtio_net" and mode == "generic":
        # The host hands virtio guests partial checksums (VIRTIO_NET_HDR_F_NEEDS_CSUM) while
        # guest checksum offload is on; native XDP makes the driver turn it off.
        return f"{name} is a virtio_net device in generic mode (use --xdp-mode native)"
    return None
