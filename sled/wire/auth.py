"""The call metadata both sides agree on for a device's identity: `authorization: Bearer TOKEN`,
as gRPC and OpenAI clients send it.

    metadata = bearer_metadata("q2VhZ...")      # (("authorization", "Bearer q2VhZ..."),)
    bearer_token(metadata) == "q2VhZ..."        # None when absent or not a bearer token
"""
from __future__ import annotations

from collections.abc import Iterable

HEADER = "authorization"          # gRPC metadata keys are lower case
SCHEME = "bearer"                 # matched without regard to case, as HTTP does
MAX_TOKEN_CHARS = 512


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token` ("" carries none)."""
    return ((HEADER, f"Bearer {token}"),) if token else ()


def bearer_token(metadata: Iterable | None) -> str | None:
    """The token of the first authorization entry that is a bearer token of sane length."""
    for entry in metadata or ():
        key, value = entry[0], entry[1]
        if key.lower() != HEADER:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() == SCHEME and token and len(token) <= MAX_TOKEN_CHARS:
            return token
    return None
