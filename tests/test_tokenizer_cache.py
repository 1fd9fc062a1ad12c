"""The device's copy of the target's tokenizer: fetched once per fingerprint into the sled cache,
used from there only while it matches that fingerprint, written from plain file names only."""
from __future__ import annotations

import pytest

from edge_client.connection import Connection, _plain_name, cached_tokenizer
from lab.tiny import make_tokenizer
from sled.cache import tokenizer_dir
from sled.fingerprint import fingerprint_tokenizer


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
    ("tokenizer.json", True), ("tokenizer_config.json", True), ("", False), (".", False),
    ("..", False), (".complete", False), ("../x.json", False), ("a/b.json", False),
    ("a\\b.json", False), ("a\0b", False),
])
def test_only_plain_file_names_are_written(name, plain):
    assert _plain_name(name) is plain
