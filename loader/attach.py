"""Attaching the programs to interfaces with pyroute2 (tc clsact ingress, or XDP).

Attachments outlive this process: the kernel's tc filter and XDP link hold the
programs, the pinned maps hold the state. A registry next to the pins' name in /run
remembers where we attached, so `kxlb unload` can find every place again.
"""
from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

from .errors import KxlbError
from .netns import netns

TC_PARENT_INGRESS = "ffff:fff2"
TC_PRIO = 0x4b1      # our filter's fixed priority and handle: replace, never duplicate
TC_HANDLE = 1
TC_NAME = "kxlb_tc"
XDP_FLAGS = {"generic": 2, "native": 4}  # XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE
REGISTRY_DIR = "/run/kxlb"


@dataclass(frozen=True)
class Attachment:
    iface: str
    netns: str | None   # None: the loader's own namespace
    hook: str           # "tc", "xdp", or "socklb" (iface is then a cgroup directory)
    mode: str = ""      # xdp: "generic" or "native"


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


def _netlink_error(exc: Exception, what: str) -> KxlbError:
    code = getattr(exc, "code", None)
    hint = " (needs root: CAP_NET_ADMIN and CAP_BPF)" if code in (errno.EPERM, errno.EACCES) else ""
    return KxlbError(f"{what}: {exc}{hint}")


def accept_local(ns: str | None, iface: str) -> None:
    """Let ``iface`` receive packets whose source is one of the node's own addresses:
    masqueraded flows (hairpin, or from outside the cluster) leave our ingress hook with
    the node's address as their source, which Linux would otherwise drop as martian."""
    with netns(ns):  # /proc/sys/net is the opening thread's namespace
        try:
            with open(f"/proc/sys/net/ipv4/conf/{iface}/accept_local", "w") as f:
                f.write("1")
        except FileNotFoundError:
            raise KxlbError(f"interface {iface!r} not found") from None


def list_links(ns: str | None) -> list[str]:
    """Names of the interfaces in a network namespace."""
    with _ipr(ns) as ipr:
        return [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]


def attach_tc(ns: str | None, iface: str, prog_fd: int) -> None:
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        try:
            ipr.tc("add", "clsact", idx)
        except Exception as exc:  # pyroute2's NetlinkError
            if getattr(exc, "code", None) != errno.EEXIST:
                raise _netlink_error(exc, f"adding clsact qdisc on {iface}") from None
        try:
            ipr.tc("replace-filter", "bpf", idx, f":{TC_HANDLE}", fd=prog_fd, name=TC_NAME,
                   parent=TC_PARENT_INGRESS, classid=1, direct_action=True, prio=TC_PRIO)
        except Exception as exc:
            raise _netlink_error(exc, f"attaching tc program on {iface}") from None


def detach_tc(ns: str | None, iface: str) -> None:
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        try:
            ipr.tc("del-filter", "bpf", idx, f":{TC_HANDLE}", parent=TC_PARENT_INGRESS, prio=TC_PRIO)
        except Exception as exc:
            if getattr(exc, "code", None) not in (errno.ENOENT, errno.EINVAL):
                raise _netlink_error(exc, f"detaching tc program from {iface}") from None
        # Remove the clsact qdisc too, unless someone else still has filters on it.
        others = [f for parent in (TC_PARENT_INGRESS, "ffff:fff3")
                  for f in ipr.get_filters(idx, parent=parent) if f.get_attr("TCA_KIND")]
        if not others:
            try:
                ipr.tc("del", "clsact", idx)
            except Exception as exc:
                if getattr(exc, "code", None) not in (errno.ENOENT, errno.EINVAL):
                    raise _netlink_error(exc, f"removing clsact from {iface}") from None


def attach_xdp(ns: str | None, iface: str, prog_fd: int, mode: str) -> None:
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        # Replacing a program in one mode by one in the other needs a detach first.
        other = "native" if mode == "generic" else "generic"
        _set_xdp(ipr, idx, -1, XDP_FLAGS[other], iface, quiet=True)
        _set_xdp(ipr, idx, prog_fd, XDP_FLAGS[mode], iface)


def detach_xdp(ns: str | None, iface: str) -> None:
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        for flags in XDP_FLAGS.values():
            _set_xdp(ipr, idx, -1, flags, iface, quiet=True)


def _set_xdp(ipr, idx: int, fd: int, flags: int, iface: str, quiet: bool = False) -> None:
    try:
        ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]})
    except Exception as exc:
        if not quiet:
            raise _netlink_error(exc, f"attaching XDP program on {iface}") from None


def xdp_attached(ns: str | None, iface: str) -> str | None:
    """'generic', 'native' or None."""
    with _ipr(ns) as ipr:
        link = ipr.get_links(_ifindex(ipr, iface, ns))[0]
        xdp = link.get_attr("IFLA_XDP")
        attached = xdp.get_attr("IFLA_XDP_ATTACHED") if xdp else None
        return {"xdpgeneric": "generic", "xdp": "native"}.get(attached)


def tc_attached(ns: str | None, iface: str) -> bool:
    with _ipr(ns) as ipr:
        idx = _ifindex(ipr, iface, ns)
        for f in ipr.get_filters(idx, parent=TC_PARENT_INGRESS):
            opts = f.get_attr("TCA_OPTIONS")
            if opts and opts.get_attr("TCA_BPF_NAME") == TC_NAME:
                return True
        return False


# --- registry ----------------------------------------------------------------------------
class Registry:
    """Where the datapath of one pin directory is attached (a JSON file under /run)."""

    def __init__(self, pin_dir: str):
        slug = pin_dir.strip("/").replace("/", "_") or "root"
        self.path = os.path.join(REGISTRY_DIR, f"{slug}.json")

    def load(self) -> list[Attachment]:
        try:
            with open(self.path) as f:
                return [Attachment(**a) for a in json.load(f)]
        except FileNotFoundError:
            return []

    def save(self, items: list[Attachment]) -> None:
        if not items:
            self.remove()
            return
        os.makedirs(REGISTRY_DIR, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump([asdict(a) for a in items], f, indent=1)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
