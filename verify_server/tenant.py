"""Who shares cached prompt blocks with whom: a session's tenant.

A prefix cache hit tells the asker that someone sent the same prompt (Opened.cached_prompt_tokens,
and a shorter prefill), so a session finds only the blocks its own tenant published. The tenant is
the caller's tenant (auth.Identity.tenant) together with the salt the client chose
(Open.cache_salt). A device its token or client certificate names shares with itself from any
address, and two such devices behind one NAT never share. A call without either is its host's
own address's (the port left out, since every stream comes from a new one; behind a trusted
proxy the host the proxy forwards), never its address block's: the block (an IPv6 /64 is a whole
LAN's, verify_server.origin.CallerPrefixes) bounds what one machine holds, but holds many devices,
so a client cannot reach another host's blocks by guessing its salt, even in its own /64. An
extra tenant costs nothing: it only scopes hits.

    tenant_key("device:cam-3", "") != tenant_key("device:dev-1", "")
    tenant_key("host:10.0.0.7", "a") != tenant_key("host:10.0.0.7", "b")
    tenant_key("host:2001:db8:1:2::7", "") != tenant_key("host:2001:db8:1:2::8", "")
"""
from __future__ import annotations

import hashlib


def tenant_key(identity: str, cache_salt: str) -> bytes:
    """The key a session's prefix hashes start from (see blocks.prefix_hashes): equal for two
    sessions exactly when they may share cached prompt blocks."""
    digest = hashlib.blake2b(digest_size=16, person=b"sled-tenant")
    for part in (identity, cache_salt):
        raw = part.encode("utf-8", "surrogatepass")
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.digest()
