"""The device's copy of the target's tokenizer: fetched once per fingerprint into the sled cache,
used from there only while it matches that fingerprint, written from the protocol's file names
only, into a folder named by a hash of the fingerprint."""
from __future__ import annotations

import hashlib

import pytest

from edge_client.connection import Connection, cached_tokenizer
from edge_client.tokenizer_chunks import TokenizerRefused
from edge_client.tokenizer_chunks import TokenizerChunks
from lab.tiny import make_tokenizer
from sled.cache import cache_dir, tokenizer_dir
from sled.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb


async def test_fetched_once_then_loaded_from_the_cache_while_it_matches(serve, models, tokenizer,
                                                                        tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    fingerprint = fingerprint_tokenizer(tokenizer)
    assert cached_tokenizer(fingerprint) is None              # nothing fetched yet
    async with Connection(server.address) as conn:
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    assert fingerprint_tokenizer(cached_tokenizer(fingerprint)) == fingerprint

    make_tokenizer(vocab_size=300).save_pretrained(tokenizer_dir(fingerprint))   # damaged copy
    assert cached_tokenizer(fingerprint) is None
    async with Connection(server.address) as conn:            # fetched again, and whole
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    assert fingerprint_tokenizer(cached_tokenizer(fingerprint)) == fingerprint


@pytest.mark.parametrize("name, plain", [
    ("tokenizer.json", True), ("tokenizer_config.json", True), ("chat_template.jinja", True),
    ("special_tokens_map.json", True), ("", False), (".", False),
    ("..", False), (".complete", False), ("../x.json", False), ("a/b.json", False),
    ("a\\b.json", False), ("a\0b", False), (".manifest.json", False), ("model.safetensors", False),
    ("evil.py", False), ("/tmp/tokenizer.json", False), ("./tokenizer.json", False),
    ("tokenizer.json/", False), ("TOKENIZER.JSON", False),
])
def test_only_plain_file_names_are_written(name, plain):
    chunks = TokenizerChunks("sha256:ab", "server:1")
    chunk = pb.TokenizerChunk(tokenizer_fingerprint="sha256:ab", name=name, data=b"{}", size=2,
                              sha256=hashlib.sha256(b"{}").hexdigest())
    if plain:
        chunks.add(chunk)
        assert chunks.files() == {name: b"{}"}
    else:
        with pytest.raises(TokenizerRefused, match="tokenizer file named"):
            chunks.add(chunk)


@pytest.mark.parametrize("fingerprint", ["sha256:ab", "/tmp/x", "../../etc", "a" * 5000, "c:\\x"])
def test_the_folder_is_named_by_a_hash_of_the_fingerprint(fingerprint, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    folder = tokenizer_dir(fingerprint)
    assert folder.parent == cache_dir() / "tokenizers"
    assert len(folder.name) == 64 and all(c in "0123456789abcdef" for c in folder.name)
