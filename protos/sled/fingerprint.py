"""Tokenizer fingerprints: device and server compare these before the first round.

Two tokenizers are compatible for speculative decoding when every id means the same token string,
so the fingerprint hashes the (id, token) table and nothing else (not the model, not the file
format). Any id space mismatch changes the hash.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping


def fingerprint_vocab(vocab: Mapping[str, int]) -> str:
    """sha256 over the vocabulary ordered by id, e.g. {"a": 0, "b": 1} -> "sha256:a2b804b1740c..."."""
    digest = hashlib.sha256()
    for token, token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    return "sha256:" + digest.hexdigest()


def fingerprint_tokenizer(tokenizer) -> str:
    """Fingerprint of a tokenizer's full vocabulary, added tokens included: transformers' tokenizer
    and the device's edge_client.tokenizer.DeviceTokenizer of the same files give the same one."""
    return fingerprint_vocab(tokenizer.get_vocab())


def short(fingerprint: str) -> str:
    """A fingerprint shortened for messages: "sha256:9a2c41d0e7f3"."""
    return fingerprint[:19]
