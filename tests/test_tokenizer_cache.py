"""The device's copy of the target's tokenizer: fetched once per fingerprint into the sled cache,
used from there only while it matches that fingerprint, written from the protocol's file names
only, into a folder named by a hash of the fingerprint."""
from __future__ import annotations

import hashlib

import pytest
from tokenizers import Tokenizer

from edge_client.connection import Connection, cached_tokenizer
from edge_client.tokenizer_chunks import TokenizerRefused
from edge_client.tokenizer_chunks import TokenizerChunks
from lab.tiny import make_tokenizer
from sled.cache import cache_dir, tokenizer_dir
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb


async def test_fetched_once_then_loaded_from_the_cache_while_it_matches(serve, models, tokenizer,
                                                                        tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    fingerprint = fingerprint_tokenizer(tokenizer)
    files = server.service.core.target.tokenizer_files_sha256
    assert cached_tokenizer(fingerprint, files) is None       # nothing fetched yet
    async with Connection(server.address) as conn:
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    assert fingerprint_tokenizer(cached_tokenizer(fingerprint, files)) == fingerprint

    make_tokenizer(vocab_size=300).save_pretrained(tokenizer_dir(fingerprint, files))   # damaged copy
    assert cached_tokenizer(fingerprint, files) is None
    async with Connection(server.address) as conn:            # fetched again, and whole
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    assert fingerprint_tokenizer(cached_tokenizer(fingerprint, files)) == fingerprint


def hostile(tokenizer):
    """The same vocabulary (so the same fingerprint) with another normalizer (e -> z) and
    another chat template: what a hostile server would send."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Replace("e", "z")
    twisted = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                      eos_token="</s>")
    twisted.chat_template = "{% for m in messages %}OBEY {{ m['content'] }}{% endfor %}"
    return twisted


async def test_a_server_with_the_same_vocabulary_and_other_files_poisons_no_other(
        serve, models, tokenizer, tmp_path, monkeypatch):
    """One contact with a server whose files differ (same fingerprint) leaves the honest server's
    tokenizer as the honest server sends it: a copy is kept per fingerprint and files digest."""
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    honest = await serve(models["llama"])
    rogue = await serve(models["llama"], tokenizer=hostile(tokenizer))
    assert rogue.service.core.target.fingerprint == honest.service.core.target.fingerprint
    assert (rogue.service.core.target.tokenizer_files_sha256
            != honest.service.core.target.tokenizer_files_sha256)
    text = "hello eeee there"
    async with Connection(rogue.address) as conn:
        poisoned = await conn.tokenizer()
    assert poisoned.encode(text) != tokenizer.encode(text)       # the attack is real
    assert poisoned.chat_template and poisoned.chat_template != tokenizer.chat_template
    for _ in range(2):                                           # fetched, then from the cache
        async with Connection(honest.address) as conn:
            got = await conn.tokenizer()
        assert got.encode(text) == tokenizer.encode(text)
        assert got.chat_template == tokenizer.chat_template
        assert got.files_sha256 == honest.service.core.target.tokenizer_files_sha256


async def test_files_other_than_the_model_info_names_are_refused(serve, models, tokenizer, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    server = await serve(models["llama"])
    honest_files = server.service.core.target.tokenizer_files_sha256
    server.service.core.target.tokenizer_reply = serve_files_of(hostile(tokenizer), server)
    monkeypatch.setattr(type(server.service.core.target), "tokenizer_files_sha256", honest_files)
    async with Connection(server.address) as conn:
        with pytest.raises(TokenizerRefused, match="other tokenizer files than its model info names"):
            await conn.tokenizer()


def serve_files_of(tokenizer, server):
    from verify_server.target import tokenizer_reply
    return tokenizer_reply(tokenizer, server.service.core.target.fingerprint)


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
    folder = tokenizer_dir(fingerprint, fingerprint)
    assert folder.parent == cache_dir() / "tokenizers"
    assert len(folder.name) == 64 and all(c in "0123456789abcdef" for c in folder.name)


async def test_a_device_encodes_with_the_files_of_the_server_it_uses(serve, models, drafter_models,
                                                                     tokenizer, tmp_path, monkeypatch):
    """A kept copy of a rogue server's files (same fingerprint) does not become the device's
    tokenizer for an honest server: the device takes the files of the server it binds to, and a
    server with other files is then not used, with the reason in its status."""
    from drafters.hf import HFDrafter
    from edge_client.daemon import Device
    from edge_client.settings import DeviceSettings

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    honest = await serve(models["llama"])
    rogue = await serve(models["llama"], tokenizer=hostile(tokenizer))
    async with Connection(rogue.address) as conn:
        await conn.tokenizer()                       # the only kept copy is the rogue's
    device = Device(DeviceSettings(id="dev-a", servers=[honest.address]),
                    load_drafter=lambda spec: HFDrafter(drafter_models["llama"], tokenizer, name=spec))
    await device.start()
    try:
        assert device.ready
        assert device.tokenizer.encode("hello eeee there") == tokenizer.encode("hello eeee there")
        assert device.tokenizer.files_sha256 == honest.service.core.target.tokenizer_files_sha256
        await device.apply({"servers": [honest.address, rogue.address]})
        problem = device.directory.servers[rogue.address].problem
        assert "tokenizer files" in problem and "not the ones this device encodes with" in problem
        assert device.directory.pick().endpoint == honest.address
    finally:
        await device.close()
