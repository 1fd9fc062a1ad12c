"""Where a call comes from: its peer's host, or, for a call through a trusted proxy, the host and
the certificate name that proxy forwards.

A proxy in front of several `sled serve` replicas (HAProxy, Envoy) is every device's peer, so its
address alone would make one device of them all. A proxy listed in --trusted-proxy (addresses or
networks, IPv4 and IPv6) says who its client is in two headers, believed from it and from no one
else (a device that sends them itself is known by its own address):

- x-forwarded-for: the client's address, appended by each proxy on the way (HAProxy's
  `option forwardfor`, Envoy). It is read from the right, past the entries of trusted proxies;
  the first other entry is the device's host. A garbled entry there ends the walk: nothing left
  of it can be believed.
- the certificate header, only when the operator names it (--proxy-cert-header; none by
  default, x-sled-client-cert in the shipped configs): the name on the client certificate the
  proxy verified when it terminated mutual TLS, set (never appended) by the proxy, which removes
  whatever its client sent under that name. Named x-forwarded-client-cert, it is read in Envoy's
  format: the Subject's common name of the element the nearest proxy added, else its first DNS
  name. Sent twice, it is ignored.

A call through a trusted proxy never takes its connection's certificate for the device's: that
is the proxy's own. A proxy that passes TLS through untouched is not listed: the device's own
certificate reaches the server, and its headers are the device's.

    proxies = TrustedProxies(("10.0.0.0/8",))
    proxies.origin([("x-forwarded-for", "192.168.1.7")], "ipv4:10.0.0.2:40000", ())
        # Origin(host="192.168.1.7", names=(), proxy="10.0.0.2")
    proxies.origin([("x-forwarded-for", "192.168.1.7")], "ipv4:172.16.0.9:40000", ())
        # Origin(host="172.16.0.9", names=(), proxy=None): not a trusted proxy

A caller that neither a token nor a certificate names is told apart by its host, and one machine
may hold many addresses: a whole IPv6 /64 may be routed to one host, and a local user can dial
from any of 127.0.0.0/8 and ::1. CallerPrefixes makes each such block one caller for its quotas
and its bounds on streams, calls, GetTokenizer replies and KV (what one machine could otherwise
multiply); its prefix cache stays its own address's (auth.Identity.tenant):

    CallerPrefixes().caller("2001:db8:1:2::7")    # "2001:db8:1:2::/64"
    CallerPrefixes().caller("127.0.0.5")          # "loopback", as is "::1"
    CallerPrefixes().caller("203.0.113.7")        # "203.0.113.7": IPv4 is /32 unless configured
"""
from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote

from sled.printable import printable

log = logging.getLogger("sled.server.origin")

FORWARDED_FOR = "x-forwarded-for"
CERT_HEADER = "x-sled-client-cert"   # what the shipped proxy configs set (deploy/), when named
ENVOY_CERT_HEADER = "x-forwarded-client-cert"
NAME_CHARS = 128               # a certificate name as a device name: printable, this long at most
HEADER_NAME = re.compile(r"[0-9a-z_.-]+")   # what gRPC allows in a metadata key
LOOPBACK_CALLER = "loopback"   # 127.0.0.0/8 and ::1 as one caller (CallerPrefixes.loopback)
MAPPED = ipaddress.ip_network("::ffff:0:0/96")      # IPv4 addresses written as IPv6 ones
WIDEST = {4: 8, 6: 32}         # the widest trusted-proxy network taken without a warning

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Origin:
    """Who a call is from, before any token: the device's host, the names of the certificate that
    proved it (its connection's, or the one a trusted proxy verified), and the trusted proxy it
    came through (None: it reached the server itself)."""
    host: str
    names: tuple[str, ...] = ()
    proxy: str | None = None

    @property
    def unnamed(self) -> bool:
        """Through a trusted proxy that said nothing of its client: the proxy's host is all
        there is to tell it by."""
        return self.proxy is not None and not self.names and self.host == self.proxy

    def __str__(self) -> str:
        shown = printable(self.host, 100)
        return shown if self.proxy is None else f"{shown} (through proxy {self.proxy})"


def ip_host(text: str) -> str | None:
    """An IP address as the host it names ("::ffff:1.2.3.4" -> "1.2.3.4"); None: not one."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def peer_host(peer: str | None) -> str:
    """The host of a gRPC peer address, without its port.

        "ipv4:1.2.3.4:5555" -> "1.2.3.4"     "ipv6:[::1]:1234" -> "::1"
        "ipv6:[::ffff:1.2.3.4]:5555" -> "1.2.3.4" (an IPv4 client of a dual-stack server)
        "unix:/run/sled.sock" -> "unix:/run/sled.sock" (no port to drop)
    """
    peer = unquote(peer or "")           # gRPC may percent-encode the brackets of IPv6
    scheme, _, address = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return ip_host(host) or host


def forwarded_host(entry: str) -> str | None:
    """One x-forwarded-for entry as a host: "1.2.3.4", "1.2.3.4:5678", "2001:db8::7",
    "[2001:db8::7]:443"; None for anything else ("unknown", a name, garbage)."""
    entry = entry.strip()
    if entry.startswith("["):
        entry, bracket, port = entry[1:].partition("]")
        return ip_host(entry) if bracket and re.fullmatch(r"(:\d+)?", port) else None
    if entry.count(":") == 1:              # IPv4 with a port
        entry, _, port = entry.partition(":")
        return ip_host(entry) if port.isdigit() else None
    return ip_host(entry)


def proxy_network(text: str) -> Network:
    """A --trusted-proxy entry: an address (one host) or a network in CIDR notation. An
    IPv4-mapped one is its IPv4 network ("::ffff:10.0.0.0/104" -> 10.0.0.0/8), as a peer's
    address is (peer_host)."""
    text = text.strip()
    try:
        return ipv4_of_mapped(ipaddress.ip_network(text))
    except ValueError:
        pass
    try:
        wide = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8, "
                         "fd00::/8)") from None
    raise ValueError(f"{text!r} has bits set past its prefix length: write {wide}, or the "
                     "address alone")


def ipv4_of_mapped(network: Network) -> Network:
    """An IPv6 network inside ::ffff:0:0/96 as the IPv4 network it maps; any other as it is."""
    if network.version == 6 and network.subnet_of(MAPPED):
        return ipaddress.IPv4Network((network.network_address.ipv4_mapped,
                                      network.prefixlen - MAPPED.prefixlen))
    return network


def wide(network: Network) -> bool:
    """Whether a trusted-proxy network spans more than a site's proxies could need (wider than
    an IPv4 /8 or an IPv6 /32): devices in it would be taken for proxies."""
    return network.prefixlen < WIDEST[network.version]


def cert_header_name(name: str) -> str:
    """A --proxy-cert-header as the metadata key gRPC hands over (lower case); ValueError for
    one that gRPC metadata cannot carry as text."""
    key = name.strip().lower()
    if key and (not HEADER_NAME.fullmatch(key) or key.startswith("grpc-") or key.endswith("-bin")
                or key in (FORWARDED_FOR, "authorization")):
        raise ValueError(f"{name!r} cannot carry a certificate name: a header of letters, digits, "
                         "'-', '_' and '.', not grpc-*, *-bin, authorization or x-forwarded-for "
                         f"(e.g. {CERT_HEADER})")
    return key


class TrustedProxies:
    """The proxies whose headers are believed (none by default: every caller is its peer), and
    the header they name devices in ("" by default: none does)."""

    def __init__(self, networks: Iterable[str] = (), cert_header: str = "") -> None:
        self.networks = tuple(proxy_network(n) for n in networks)
        self.cert_header = cert_header_name(cert_header)

    def warn_wide(self) -> None:
        """Say, as the server starts, which trusted networks are wide enough to hold devices."""
        for network in filter(wide, self.networks):
            headers = FORWARDED_FOR + (f" and {self.cert_header}" if self.cert_header else "")
            log.warning("--trusted-proxy %s is wider than an IPv%d /%d: a device in it is taken "
                        "for a proxy and believed in %s; list the proxies' own addresses",
                        network, network.version, WIDEST[network.version], headers)

    @property
    def name_devices(self) -> bool:
        """Whether a trusted proxy may name devices by their certificates."""
        return bool(self.networks and self.cert_header)

    def trusts(self, host: str) -> bool:
        """Whether `host` (an address as peer_host gives it) is a trusted proxy's."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)

    def origin(self, metadata, peer: str | None, names: Iterable[str] = ()) -> Origin:
        """Where the call comes from: its peer and its connection's certificate names, unless
        the peer is a trusted proxy, whose headers then say it."""
        host = peer_host(peer)
        if not self.trusts(host):
            return Origin(host, tuple(names))
        metadata = list(metadata or ())
        name = self.certificate(metadata)
        return Origin(self.forwarded(metadata) or host, (name,) if name else (), proxy=host)

    def forwarded(self, metadata: list) -> str | None:
        """The device's host in x-forwarded-for: the rightmost entry no trusted proxy added."""
        entries = [entry for key, value in metadata if key == FORWARDED_FOR
                   for entry in value.split(",")]
        host = None
        for entry in reversed(entries):
            host = forwarded_host(entry)
            if host is None or not self.trusts(host):
                return host
        return host           # every hop a trusted proxy: the first of them

    def certificate(self, metadata: list) -> str | None:
        """The certificate name the proxy verified; None when it sent none, or sent it twice
        (a device's own copy came along: neither can be believed)."""
        values = [value for key, value in metadata if key == self.cert_header] if self.cert_header \
            else []
        if len(values) != 1:
            return None
        name = envoy_cert_name(values[0]) if self.cert_header == ENVOY_CERT_HEADER else values[0]
        name = printable((name or "").strip(), NAME_CHARS)
        return name or None


@dataclass(frozen=True, slots=True)
class CallerPrefixes:
    """How much of a host's address tells one tokenless caller from another: the leading `v4`
    bits of an IPv4 address, `v6` of an IPv6 one, and every loopback address (127.0.0.0/8 and
    ::1) as one when `loopback`. A host that is not an IP address (unix:PATH) is itself."""
    v4: int = 32
    v6: int = 64
    loopback: bool = True

    def caller(self, host: str) -> str:
        """The address block `host` counts in, as a caller's name: "2001:db8:1:2::/64",
        "loopback", or the address itself when the block is one address."""
        try:
            ip = ipaddress.ip_address(ip_host(host) or host)
        except ValueError:
            return host
        if self.loopback and ip.is_loopback:
            return LOOPBACK_CALLER
        prefix = self.v4 if ip.version == 4 else self.v6
        if prefix == ip.max_prefixlen:
            return str(ip)
        return str(ipaddress.ip_network((ip, prefix), strict=False))


# --- Envoy's x-forwarded-client-cert -------------------------------------------------------------

def split_unquoted(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside double quotes (a backslash escapes the next one)."""
    parts, current, quoted, escaped = [], [], False, False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def xfcc_value(raw: str) -> str:
    """A value of x-forwarded-client-cert: its quotes off, its escaped quotes plain."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        raw = raw[1:-1].replace('\\"', '"')
    return raw


def envoy_cert_name(value: str) -> str | None:
    """The name in an x-forwarded-client-cert value: of its last element (the nearest proxy's),
    the Subject's common name (RFC 2253 "CN=dev-1,O=fleet", or OpenSSL's "/O=fleet/CN=dev-1"),
    else the first DNS name.

        'Hash=ab12;Subject="CN=dev-1,O=fleet";DNS=dev-1.lan' -> "dev-1"
    """
    fields: dict[str, str] = {}
    for pair in split_unquoted(split_unquoted(value, ",")[-1], ";"):
        key, _, raw = pair.partition("=")
        fields.setdefault(key.strip().lower(), raw)
    subject = xfcc_value(fields.get("subject", ""))
    for attribute in split_unquoted(subject, "/" if subject.startswith("/") else ","):
        kind, _, name = attribute.partition("=")
        if kind.strip().upper() == "CN" and name.strip():
            return re.sub(r"\\(.)", r"\1", name.strip())     # RFC 4514 escapes: "\," is ","
    return xfcc_value(fields["dns"]) if fields.get("dns") else None
