"""Per-interface IPv4 settings (net.ipv4.conf.IFACE.*) the datapath needs, written over
rtnetlink rather than /proc/sys.

Why netlink: /proc/sys is read-only in any container that is not privileged, and a
DaemonSet should need CAP_NET_ADMIN, not privilege, to configure the node's interfaces.
RTM_SETLINK with IFLA_AF_SPEC / AF_INET / IFLA_INET_CONF sets a device's IPv4 settings by
their index in the kernel's ipv4_devconf (include/uapi/linux/ip.h), which is what
`sysctl net.ipv4.conf.IFACE.X` writes too. Reading goes through /proc/sys (readable in
every container) for "all", and RTM_GETLINK for a device.

Two settings, both about the source addresses our ingress hook gives packets before the
kernel routes them (docs/datapath.md, "Reverse-path filtering"):
- accept_local=1: a masqueraded packet arrives with one of the node's own addresses as its
  source, which Linux otherwise drops as martian;
- rp_filter: a translated reply arrives with a service address as its source (and a
  masqueraded packet with the node's). Strict reverse-path filtering (1: the route back to
  the source must leave by this very interface; CIS benchmarks and kind set it) drops
  them; loose (2: a route to the source exists at all) and off (0) let them in. The
  effective value is the larger of conf.all and the device's, so a device is made loose:
  lowering conf.all would change every interface of the node.
"""
from __future__ import annotations

import errno
import os
import socket
import struct

from .errors import KxlbError
from .netns import netns

RTM_SETLINK, NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 19, 1, 4, 2
IFLA_AF_SPEC, IFLA_INET_CONF = 26, 1
DEVCONF = {"rp_filter": 8, "accept_local": 23}   # enum IPV4_DEVCONF_* (1-based)
RP_STRICT, RP_LOOSE = 1, 2


def _nla(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def set_conf(ns: str | None, iface: str, values: dict[str, int]) -> None:
    """Set net.ipv4.conf.IFACE.<name> = value for each of ``values`` (one message)."""
    with netns(ns):
        try:
            index = socket.if_nametoindex(iface)
        except OSError:
            raise KxlbError(f"interface {iface!r} not found") from None
        conf = b"".join(_nla(DEVCONF[name], struct.pack("=I", v)) for name, v in values.items())
        attrs = _nla(IFLA_AF_SPEC, _nla(socket.AF_INET, _nla(IFLA_INET_CONF, conf)))
        body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, 0, 0) + attrs  # struct ifinfomsg
        msg = struct.pack("=IHHII", 16 + len(body), RTM_SETLINK, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
            s.bind((0, 0))
            s.send(msg)
            reply = s.recv(65536)
    _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
    err = -struct.unpack_from("=i", reply, 16)[0] if kind == NLMSG_ERROR else 0
    if err:
        what = ", ".join(f"net.ipv4.conf.{iface}.{k}={v}" for k, v in values.items())
        hint = " (needs CAP_NET_ADMIN in the node's network namespace)" if err in (errno.EPERM, errno.EACCES) else ""
        raise KxlbError(f"cannot set {what}: {os.strerror(err)}{hint}")


def get_conf(ns: str | None, iface: str, name: str) -> int:
    """net.ipv4.conf.<iface>.<name> (iface may be "all")."""
    with netns(ns):  # /proc/sys/net is the opening thread's namespace
        try:
            with open(f"/proc/sys/net/ipv4/conf/{iface}/{name}") as f:
                return int(f.read())
        except FileNotFoundError:
            raise KxlbError(f"interface {iface!r} not found") from None


def effective_rp_filter(ns: str | None, iface: str) -> int:
    return max(get_conf(ns, "all", "rp_filter"), get_conf(ns, iface, "rp_filter"))


def prepare_interface(ns: str | None, iface: str) -> None:
    """accept_local on, and reverse-path filtering loose where it would be strict; a
    device whose effective filtering stays strict is refused with one line."""
    values = {"accept_local": 1}
    if effective_rp_filter(ns, iface) == RP_STRICT:
        values["rp_filter"] = RP_LOOSE
    set_conf(ns, iface, values)
    if effective_rp_filter(ns, iface) == RP_STRICT:
        raise KxlbError(f"reverse-path filtering on {iface} stays strict (net.ipv4.conf.all.rp_filter and "
                        f"net.ipv4.conf.{iface}.rp_filter): translated replies would be dropped; set it to 2 "
                        f"(loose) or 0 (docs/datapath.md, Reverse-path filtering)")
