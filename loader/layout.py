"""Python mirrors of the datapath's map layouts (bpf/maps.h) and constants (bpf/consts.h).

The structs are ctypes mirrors, checked field by field against the BTF clang emits for
maps.h (tests/test_layout.py). The constants are read from consts.h itself, so there is
one place to change them. Network-order fields hold the raw wire bytes; the dataclasses
at the boundary (Backend, ServiceKey) speak dotted quads and host-order ports.
"""
from __future__ import annotations

import ctypes
import ipaddress
import re
import socket
import struct
import sys
from typing import NamedTuple
from pathlib import Path

from .errors import KxlbError

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"


def _read_constants(path: Path) -> dict[str, int]:
    consts = {}
    for m in re.finditer(r"^#define\s+KXLB_(\w+)\s+(0x[0-9a-fA-F]+|\d+)u?\b", path.read_text(), re.M):
        consts[m.group(1)] = int(m.group(2), 0)
    return consts


C = _read_constants(BPF_DIR / "consts.h")
"""Every ``#define KXLB_NAME value`` of consts.h, as C["NAME"]."""

PROTOS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}
PROTO_NAMES = {v: k for k, v in PROTOS.items()}

DP_COUNTERS = {v: k.removeprefix("ST_").lower() for k, v in C.items()
               if k.startswith("ST_") and k != "ST_MAX"}
"""dp_stats index -> counter name (from the KXLB_ST_* defines)."""

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class SvcKey(ctypes.Structure):
    _fields_ = [("vip", u32), ("port", u16), ("proto", u8), ("pad", u8)]


class SvcValue(ctypes.Structure):
    _fields_ = [("svc_id", u32), ("count", u16), ("local_count", u16), ("gen", u8), ("kind", u8),
                ("flags", u16), ("affinity_s", u32), ("table_size", u16), ("local_table_size", u16)]


class BackendKey(ctypes.Structure):
    _fields_ = [("svc_id", u32), ("slot", u16), ("gen", u8), ("set", u8)]


class BackendValue(ctypes.Structure):
    _fields_ = [("addr", u32), ("port", u16), ("pad", u16)]


class MaglevKey(ctypes.Structure):
    _fields_ = [("svc_id", u32), ("chunk", u16), ("gen", u8), ("set", u8)]


class MaglevChunk(ctypes.Structure):
    _fields_ = [("slot", u16 * C["MAGLEV_CHUNK"])]


class CtKey(ctypes.Structure):
    _fields_ = [("saddr", u32), ("daddr", u32), ("sport", u16), ("dport", u16),
                ("proto", u8), ("dir", u8), ("pad", u16)]


class CtEntry(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("flags", u64), ("client_addr", u32), ("front_addr", u32),
                ("backend_addr", u32), ("src_addr", u32), ("client_port", u16), ("front_port", u16),
                ("backend_port", u16), ("src_port", u16), ("svc_id", u32), ("created_s", u32)]


class FragKey(ctypes.Structure):
    _fields_ = [("saddr", u32), ("daddr", u32), ("id", u16), ("proto", u8), ("pad", u8)]


class FragValue(ctypes.Structure):
    _fields_ = [("saddr", u32), ("daddr", u32)]


class AffinityKey(ctypes.Structure):
    _fields_ = [("svc_id", u32), ("client", u32), ("set", u8), ("pad", u8 * 3)]


class AffinityValue(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("addr", u32), ("port", u16), ("pad", u16)]


class SrcRangeKey(ctypes.Structure):
    _fields_ = [("prefixlen", u32), ("svc_id", u32), ("addr", u32)]


class LbConfig(ctypes.Structure):
    _fields_ = [("snat_addr", u32), ("cluster_cidr", u32), ("cluster_mask", u32), ("flags", u32),
                ("svc_cidr", u32 * C["MAX_SVC_CIDRS"]), ("svc_mask", u32 * C["MAX_SVC_CIDRS"]),
                ("src_port_min", u16), ("src_port_max", u16), ("node_addr", u32)]


class SockRevKey(ctypes.Structure):
    _fields_ = [("cookie", u64), ("addr", u32), ("port", u16), ("pad", u16)]


class SockRevValue(ctypes.Structure):
    _fields_ = [("vip", u32), ("port", u16), ("pad", u16)]


class SvcCounters(ctypes.Structure):
    _fields_ = [("fwd_packets", u64), ("fwd_bytes", u64), ("rev_packets", u64),
                ("rev_bytes", u64), ("new_flows", u64)]


# --- IPv6: the same structs with 16-byte addresses (maps.h) ---------------------------

class In6(ctypes.Structure):
    """struct kx_in6: an IPv6 address as four network-order words (raw wire bytes)."""
    _fields_ = [("w", u32 * 4)]


class SvcKey6(ctypes.Structure):
    _fields_ = [("vip", In6), ("port", u16), ("proto", u8), ("pad", u8)]


class BackendValue6(ctypes.Structure):
    _fields_ = [("addr", In6), ("port", u16), ("pad", u16)]


class CtKey6(ctypes.Structure):
    _fields_ = [("saddr", In6), ("daddr", In6), ("sport", u16), ("dport", u16),
                ("proto", u8), ("dir", u8), ("pad", u16)]


class CtEntry6(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("flags", u64), ("client_addr", In6), ("front_addr", In6),
                ("backend_addr", In6), ("src_addr", In6), ("client_port", u16), ("front_port", u16),
                ("backend_port", u16), ("src_port", u16), ("svc_id", u32), ("created_s", u32)]


class FragKey6(ctypes.Structure):
    _fields_ = [("saddr", In6), ("daddr", In6), ("id", u32), ("proto", u8), ("pad", u8 * 3)]


class FragValue6(ctypes.Structure):
    _fields_ = [("saddr", In6), ("daddr", In6)]


class AffinityKey6(ctypes.Structure):
    _fields_ = [("svc_id", u32), ("client", In6), ("set", u8), ("pad", u8 * 3)]


class AffinityValue6(ctypes.Structure):
    _fields_ = [("last_ns", u64), ("addr", In6), ("port", u16), ("pad", u16), ("pad2", u32)]


class SrcRangeKey6(ctypes.Structure):
    _fields_ = [("prefixlen", u32), ("svc_id", u32), ("addr", In6)]


class SockRevKey6(ctypes.Structure):
    _fields_ = [("cookie", u64), ("addr", In6), ("port", u16), ("pad", u16), ("pad2", u32)]


class SockRevValue6(ctypes.Structure):
    _fields_ = [("vip", In6), ("port", u16), ("pad", u16)]


class LbConfig6(ctypes.Structure):
    _fields_ = [("snat_addr", In6), ("cluster_cidr", In6), ("cluster_mask", In6), ("flags", u32),
                ("svc_cidr", In6 * C["MAX_SVC_CIDRS"]), ("svc_mask", In6 * C["MAX_SVC_CIDRS"]),
                ("src_port_min", u16), ("src_port_max", u16), ("node_addr", In6)]


MIRRORS: dict[str, type[ctypes.Structure]] = {
    "svc_key": SvcKey, "svc_value": SvcValue, "backend_key": BackendKey, "backend": BackendValue,
    "maglev_key": MaglevKey, "maglev_chunk": MaglevChunk,
    "ct_key": CtKey, "ct_entry": CtEntry, "frag_key": FragKey, "frag_value": FragValue,
    "affinity_key": AffinityKey, "affinity_value": AffinityValue, "src_range_key": SrcRangeKey,
    "lb_config": LbConfig, "sock_rev_key": SockRevKey, "sock_rev_value": SockRevValue, "svc_counters": SvcCounters,
    "kx_in6": In6, "svc_key6": SvcKey6, "backend6": BackendValue6, "ct_key6": CtKey6, "ct_entry6": CtEntry6,
    "frag_key6": FragKey6, "frag_value6": FragValue6, "affinity_key6": AffinityKey6,
    "affinity_value6": AffinityValue6, "src_range_key6": SrcRangeKey6, "lb_config6": LbConfig6,
    "sock_rev_key6": SockRevKey6, "sock_rev_value6": SockRevValue6,
}
"""C struct name -> ctypes mirror; the layout test walks this table."""


# --- wire encodings -------------------------------------------------------------------

_ORDER = sys.byteorder  # a u32 field holds network-order bytes read in host order

def ip_to_raw(ip: str) -> int:
    """Dotted quad -> u32 whose memory holds the address in network order."""
    return int.from_bytes(socket.inet_aton(ip), _ORDER)


def raw_to_ip(raw: int) -> str:
    return socket.inet_ntoa(raw.to_bytes(4, _ORDER))


def ip6_to_c(ip: str) -> In6:
    """IPv6 text -> struct kx_in6 holding the address's wire bytes."""
    return In6.from_buffer_copy(socket.inet_pton(socket.AF_INET6, ip))


def c_to_ip6(addr: In6) -> str:
    return socket.inet_ntop(socket.AF_INET6, bytes(addr))


def port_to_raw(port: int) -> int:
    return socket.htons(port)


def raw_to_port(raw: int) -> int:
    return socket.ntohs(raw)




# --- address families -------------------------------------------------------------------

class Family:
    """What differs between the IPv4 and IPv6 halves of the datapath (maps.h: every map
    with an address in its key or value exists per family, the IPv6 one named with a 6;
    the service ids, Maglev tables and counters are shared). Everything that packs,
    unpacks or picks a map asks the family of the address at hand instead of assuming
    IPv4. Two instances, V4 and V6."""

    def __init__(self, version: int, af: int, addr_len: int, suffix: str, addr_t, svc_key_t, backend_t,
                 src_range_key_t, affinity_key_t, affinity_value_t, config_t, network: type, address: type):
        self.version, self.af, self.addr_len, self.suffix = version, af, addr_len, suffix
        self.addr_t = addr_t          # the ctypes type of an address field (u32 or struct kx_in6)
        self.SvcKey, self.BackendValue, self.SrcRangeKey = svc_key_t, backend_t, src_range_key_t
        self.AffinityKey, self.AffinityValue, self.LbConfig = affinity_key_t, affinity_value_t, config_t
        self.network, self.address = network, address
        self.max_prefix = addr_len * 8
        a = f"{addr_len}s"
        # Bulk packing of the structs writers make by the thousand (checked against the
        # ctypes mirrors by tests/test_layout.py): struct svc_key(6), struct backend(6),
        # and backend(6) read with the port as a number (network order).
        self.svc_key = struct.Struct(f"={a}2sBB")
        self.backend = struct.Struct(f"={a}2sH")
        self.backend_read = struct.Struct(f"!{a}Hxx")
        # A backend's Maglev identity (maglev.identity): address and port in network
        # order, the first bytes of its packed struct backend(6).
        self.ident_len = addr_len + 2

    def __repr__(self) -> str:
        return f"IPv{self.version}"

    @property
    def name(self) -> str:
        return f"IPv{self.version}"

    def pton(self, ip: str) -> bytes:
        return socket.inet_pton(self.af, ip)

    def ntop(self, raw: bytes) -> str:
        return socket.inet_ntop(self.af, raw)

    def addr_c(self, ip: str):
        """Text -> the value of a ctypes address field of this family."""
        raw = self.pton(ip)
        return int.from_bytes(raw, _ORDER) if self.addr_len == 4 else In6.from_buffer_copy(raw)

    def c_addr(self, field) -> str:
        """A ctypes address field's value -> text."""
        return self.ntop(field.to_bytes(4, _ORDER) if isinstance(field, int) else bytes(field))

    def map(self, maps, name: str):
        """This family's map of a per-family name ("services" -> maps.services6)."""
        return getattr(maps, name + self.suffix)

    def parse(self, text: str, what: str) -> str:
        """``text`` as this family's canonical address, else a KxlbError naming ``what``."""
        try:
            return canonical_ip(str(self.address(text)))
        except ValueError:
            raise KxlbError(f"{what}: {text!r} is not an {self.name} address") from None

    def parse_net(self, text: str, what: str):
        try:
            return self.network(text, strict=False)
        except ValueError:
            raise KxlbError(f"{what} {text!r} is not an {self.name} network") from None


V4 = Family(4, socket.AF_INET, 4, "", u32, SvcKey, BackendValue, SrcRangeKey, AffinityKey, AffinityValue, LbConfig,
            ipaddress.IPv4Network, ipaddress.IPv4Address)
V6 = Family(6, socket.AF_INET6, 16, "6", In6, SvcKey6, BackendValue6, SrcRangeKey6, AffinityKey6, AffinityValue6,
            LbConfig6, ipaddress.IPv6Network, ipaddress.IPv6Address)
FAMILIES = (V4, V6)


def family_of(ip: str) -> Family:
    """The family of an address (or CIDR) in canonical text form."""
    return V6 if ":" in ip else V4


# --- boundary types -------------------------------------------------------------------

# Addresses no service or backend can have. Kubernetes refuses unspecified, loopback and
# link-local addresses (and link-local multicast) for endpoints and external IPs
# (ValidateEndpointIP / ValidateNonSpecialIP in pkg/apis/core/validation). kxlb also
# refuses the rest of multicast, which Kubernetes lets through ("probably a bug", says its
# comment), and the IPv4 broadcast address: neither names one host, so a connection to or
# through them cannot be translated and answered.
_SPECIAL = tuple((ipaddress.ip_network(net), why) for net, why in (
    ("0.0.0.0/32", "the unspecified address"), ("::/128", "the unspecified address"),
    ("255.255.255.255/32", "the broadcast address"),
    ("127.0.0.0/8", "loopback (127.0.0.0/8)"), ("::1/128", "loopback (::1)"),
    ("169.254.0.0/16", "link-local (169.254.0.0/16)"), ("fe80::/10", "link-local (fe80::/10)"),
    ("224.0.0.0/4", "multicast (224.0.0.0/4)"), ("ff00::/8", "multicast (ff00::/8)"),
))

_DOTTED_QUAD = re.compile(r"[0-9]+(\.[0-9]+){3}")


def parse_ip(text: str, what: str) -> str:
    """A service or backend address in canonical text form (IPv6 compressed, lower case).
    Refused: what is not an IP address, IPv4 octets with a leading zero (ambiguous: octal
    to inet_aton, decimal to Go and Python, hence CVE-2021-29923), IPv4-mapped IPv6
    addresses (a service or backend has one family), IPv6 zone indexes (the maps hold bare
    addresses) and the special addresses of _SPECIAL."""
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        if _DOTTED_QUAD.fullmatch(text) and any(len(o) > 1 and o[0] == "0" for o in text.split(".")):
            raise KxlbError(f"{what}: {text!r} has an IPv4 octet with a leading zero, which some "
                            "parsers read as octal: write it without") from None
        raise KxlbError(f"{what}: {text!r} is not an IP address") from None
    if addr.version == 6 and addr.ipv4_mapped is not None:
        raise KxlbError(f"{what}: {text!r} is an IPv4-mapped IPv6 address; give the IPv4 address")
    if addr.version == 6 and addr.scope_id is not None:
        raise KxlbError(f"{what}: {text!r} has an IPv6 zone index (%{addr.scope_id}): "
                        "give the address without it")
    for net, why in _SPECIAL:
        if addr in net:
            raise KxlbError(f"{what}: {text!r} is {why}: not usable as a service or backend address")
    return canonical_ip(str(addr))


def canonical_ip(text: str) -> str:
    """The one text form of a valid address: inet_ntop's, which is what reading a map
    gives back (it differs from ipaddress's for IPv6 with an embedded IPv4 address), so
    what a writer wants and what the maps hold compare with ==."""
    if ":" not in text:
        return text
    return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, text))


def parse_net(text: str, what: str):
    """An IPv4 or IPv6 CIDR (host bits allowed, as kube-proxy's flags allow them)."""
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise KxlbError(f"{what} {text!r} is not an IPv4 or IPv6 CIDR") from None


def format_addr_port(addr: str, port: int) -> str:
    """ADDR:PORT, with an IPv6 address in brackets (RFC 3986)."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


_DECIMAL = re.compile(r"[0-9]+")   # [0-9], not \d: \d matches every script's digits


def parse_number(text: str, what: str, lo: int, hi: int) -> int:
    """``text`` as an integer lo..hi written in ASCII decimal digits; leading zeros are
    allowed ('080' is 80), as Go's strconv.Atoi and so kube-proxy take them. Not int(text)
    alone: it also takes a sign, underscores, surrounding spaces and other scripts' digits
    ('+81', '8_0', ' 81', '٨٠')."""
    if not _DECIMAL.fullmatch(text):
        raise KxlbError(f"{what} {text!r} is not a decimal number")
    digits = text.lstrip("0") or "0"
    # Longer than hi is out of range (and int() refuses strings of thousands of digits).
    if len(digits) > len(str(hi)) or not lo <= int(digits) <= hi:
        raise KxlbError(f"{what} {text} is out of range {lo}-{hi}")
    return int(digits)


def parse_port(text: str | int, what: str) -> int:
    return parse_number(str(text), f"{what}: port", 1, 65535)


def parse_proto(text: str, what: str) -> int:
    proto = PROTOS.get(text.lower())
    if proto is None:
        raise KxlbError(f"{what}: unknown protocol {text!r} (expected tcp or udp)")
    return proto


def parse_addr_port(text: str, what: str, form: str) -> tuple[str, int]:
    """'ADDR:PORT' or '[IPV6]:PORT' -> (canonical address, port); errors name ``what``
    and the expected form."""
    addr, colon, port = text.rpartition(":")
    if not colon:
        raise KxlbError(f"{what}: expected {form}")
    if addr.startswith("[") and addr.endswith("]"):
        addr = parse_ip(addr[1:-1], what)
        if ":" not in addr:
            raise KxlbError(f"{what}: brackets are for IPv6 addresses")
        return addr, parse_port(port, what)
    if ":" in addr:
        raise KxlbError(f"{what}: an IPv6 address needs brackets: [ADDR]:PORT")
    return parse_ip(addr, what), parse_port(port, what)


class ServiceKey(NamedTuple):
    """A service as clients address it. A NamedTuple (not a dataclass): the controller
    makes one per service port per sync, and tuples are cheap to build and hash."""

    vip: str
    port: int
    proto: int

    @classmethod
    def parse(cls, text: str) -> "ServiceKey":
        """'VIP:PORT/PROTO' (an IPv6 VIP in brackets) as on the command line."""
        what, form = f"service {text!r}", "VIP:PORT/tcp|udp or [VIP6]:PORT/tcp|udp"
        addr, slash, proto = text.rpartition("/")
        if not slash:
            raise KxlbError(f"{what}: expected {form}")
        return cls(*parse_addr_port(addr, what, form), parse_proto(proto, what))

    @property
    def family(self) -> Family:
        return family_of(self.vip)

    def to_c(self):
        """struct svc_key, or svc_key6 for an IPv6 VIP."""
        fam = family_of(self.vip)
        return fam.SvcKey(vip=fam.addr_c(self.vip), port=port_to_raw(self.port), proto=self.proto)

    @classmethod
    def from_c(cls, k) -> "ServiceKey":
        fam = V6 if isinstance(k, SvcKey6) else V4
        return cls(fam.c_addr(k.vip), raw_to_port(k.port), k.proto)

    def __str__(self) -> str:
        return f"{format_addr_port(self.vip, self.port)}/{PROTO_NAMES.get(self.proto, self.proto)}"


class Backend(NamedTuple):
    """Where a service slot sends new flows (a NamedTuple, for the same reason)."""

    addr: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "Backend":
        return cls(*parse_addr_port(text, f"backend {text!r}", "ADDR:PORT"))

    @property
    def family(self) -> Family:
        return family_of(self.addr)

    def to_c(self):
        """struct backend, or backend6 for an IPv6 address."""
        fam = family_of(self.addr)
        return fam.BackendValue(addr=fam.addr_c(self.addr), port=port_to_raw(self.port))

    @classmethod
    def from_c(cls, v) -> "Backend":
        fam = V6 if isinstance(v, BackendValue6) else V4
        return cls(fam.c_addr(v.addr), raw_to_port(v.port))

    def __str__(self) -> str:
        return format_addr_port(self.addr, self.port)
