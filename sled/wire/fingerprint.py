"""Tokenizer fingerprints: device and server compare these before the first round.

Two tokenizers are compatible for speculative decoding when every id means the same token string,
so the fingerprint hashes the (id, token) table and nothing else (not the model, not the file
format). Any id space mismatch changes the hash. Text to ids is another matter: the normalizer,
pre-tokenizer and chat template are in the files, which files_fingerprint names.
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


def files_fingerprint(file_sha256: Mapping[str, str]) -> str:
    """What a tokenizer's files are, exactly (ModelInfo.tokenizer_files_sha256): sha256 over one
    "name<TAB>sha256 hex<NEWLINE>" line per file, sorted by name. The vocabulary's fingerprint
    above leaves out the normalizer, the pre-tokenizer and the chat template: this covers them."""
    lines = "".join(f"{name}\t{sha256}\n" for name, sha256 in sorted(file_sha256.items()))
    return "sha256:" + hashlib.sha256(lines.encode("utf-8", "surrogatepass")).hexdigest()


def short(fingerprint: str) -> str:
    """A fingerprint shortened for messages: "sha256:9a2c41d0e7f3"."""
    return fingerprint[:19]
