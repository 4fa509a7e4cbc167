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

from .cstructs import parse as parse_structs
from .errors import KxlbError

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"


def _read_constants(path: Path) -> dict[str, int]:
    consts = {}
    for m in re.finditer(r"^#define\s+KXLB_(\w+)\s+(0x[0-9a-fA-F]+|\d+)u?\b", path.read_text(), re.M):
        consts[m.group(1)] = int(m.group(2), 0)
    return consts


C = _read_constants(BPF_DIR / "consts.h")
"""Every ``#define KXLB_NAME value`` of consts.h, as C["NAME"]."""

PROTOS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": socket.IPPROTO_SCTP}
"""The protocols a Service port can have (kube-proxy's three; bpf/sctp.h for SCTP)."""
PROTO_NAMES = {v: k for k, v in PROTOS.items()}

DP_COUNTERS = {v: k.removeprefix("ST_").lower() for k, v in C.items()
               if k.startswith("ST_") and k != "ST_MAX"}
"""dp_stats index -> counter name (from the KXLB_ST_* defines)."""

MIRRORS: dict[str, type[ctypes.Structure]] = parse_structs(BPF_DIR / "maps.h", C)
"""C struct name -> ctypes class, made from maps.h itself (loader/cstructs.py); the layout
test checks each against the BTF clang emits for it."""

(SvcKey, SvcValue, BackendValue, MaglevKey, MaglevChunk, CtKey, CtFlow, CtEntry, MasqWay, MasqEntry,
 FragKey, FragValue, AffinityKey, AffinityValue, SrcRangeKey, LbConfig, SockRevKey, SockRevValue, SvcCounters,
 In6, SvcKey6, BackendValue6, CtKey6, CtFlow6, CtEntry6, MasqWay6, MasqEntry6, FragKey6, FragValue6, AffinityKey6,
 AffinityValue6, SrcRangeKey6, LbConfig6, SockRevKey6, SockRevValue6) = (MIRRORS[n] for n in (
    "svc_key", "svc_value", "backend", "maglev_key", "maglev_chunk", "ct_key", "ct_flow", "ct_entry",
    "masq_way", "masq_entry", "frag_key", "frag_value", "affinity_key", "affinity_value", "src_range_key",
    "lb_config", "sock_rev_key", "sock_rev_value", "svc_counters", "kx_in6", "svc_key6", "backend6", "ct_key6",
    "ct_flow6", "ct_entry6", "masq_way6", "masq_entry6", "frag_key6", "frag_value6", "affinity_key6",
    "affinity_value6", "src_range_key6", "lb_config6", "sock_rev_key6", "sock_rev_value6"))


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
        # ctypes mirrors by tests/test_layout.py): struct svc_key(6), struct backend(6)
        # (its port in network order, its tag in host order).
        self.svc_key = struct.Struct(f"={a}2sBB")
        self.backend = struct.Struct(f"={a}2sH")
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

    def struct(self, name: str) -> type:
        """This family's struct of a per-family name ("ct_key" -> struct ct_key6)."""
        return MIRRORS[name + self.suffix]

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


V4 = Family(4, socket.AF_INET, 4, "", ctypes.c_uint32, SvcKey, BackendValue, SrcRangeKey, AffinityKey, AffinityValue, LbConfig,
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
        raise KxlbError(f"{what}: unknown protocol {text!r} (expected {', '.join(PROTOS)})")
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
        what, form = f"service {text!r}", "VIP:PORT/tcp|udp|sctp or [VIP6]:PORT/tcp|udp|sctp"
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
