"""Who shares cached prompt blocks with whom: a session's tenant.

A prefix cache hit tells the asker that someone sent the same prompt (Opened.cached_prompt_tokens,
and a shorter prefill), so a session finds only the blocks its own tenant published. When a call
lacks an authenticated identity, the tenant is the peer's host together with the salt the client
chose (Open.cache_salt): a client cannot reach another host's blocks by guessing its salt. The
port is left out, since every stream comes from a new one. An authenticated identity (a device's
token or client certificate, verify_server.auth) takes the host's place in `tenant_key`: two
devices behind one NAT never share, one device's sessions do from any address.

    tenant_key("ipv4:10.0.0.7:51234", "cam-3") == tenant_key("ipv4:10.0.0.7:40001", "cam-3")
    tenant_key("ipv4:10.0.0.7:51234", "cam-3") != tenant_key("ipv4:10.0.0.8:51234", "cam-3")
"""
from __future__ import annotations

import hashlib
import ipaddress
from urllib.parse import unquote


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
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def tenant_key(peer: str | None, cache_salt: str, identity: str | None = None) -> bytes:
    """The key a session's prefix hashes start from (see blocks.prefix_hashes): equal for two
    sessions exactly when they may share cached prompt blocks. `identity`, a device proven by
    its token or certificate (auth.Identity.key), takes the host's place."""
    identity = identity or "host:" + peer_host(peer)
    digest = hashlib.blake2b(digest_size=16, person=b"sled-tenant")
    for part in (identity, cache_salt):
        raw = part.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.digest()
