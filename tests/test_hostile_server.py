"""A hostile verify server: nothing it sends becomes a path or a file outside the device's cache,
and both `sled generate` and the daemon refuse it with one line.

The fake server answers GetModelInfo and GetTokenizer (a stream of chunks) with whatever a test
chooses; the device
runs with SLED_CACHE inside tmp_path, and afterwards nothing may exist under tmp_path outside that
cache (the fake's absolute names and `..` paths all point into tmp_path).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from edge_client.daemon import Device
from edge_client.tokenizer_chunks import TokenizerChunks, TokenizerRefused
from edge_client.settings import DeviceSettings
from sled.cache import MAX_TOKENIZER_BYTES, MAX_TOKENIZER_CHUNK_BYTES
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc


class HostileVerifier(pb_grpc.VerifierServicer):
    def __init__(self, info: pb.ModelInfo, chunks: list[pb.TokenizerChunk], refusal: str = "") -> None:
        self.info, self.chunks, self.refusal = info, chunks, refusal

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetTokenizer(self, request, context):
        if self.refusal:   # the server's own words, for the device to show
            await context.abort(grpc.StatusCode.INTERNAL, self.refusal)
        for chunk in self.chunks:
            yield chunk


def chunked(fingerprint: str, files: dict[str, bytes], piece: int = 4096) -> list[pb.TokenizerChunk]:
    """FILES as an honest server streams them, in chunks of PIECE bytes (so that even the tiny
    tokenizer's files take several)."""
    chunks = []
    for name, content in files.items():
        digest = hashlib.sha256(content).hexdigest()
        for offset in range(0, max(len(content), 1), piece):
            chunks.append(pb.TokenizerChunk(tokenizer_fingerprint=fingerprint, name=name,
                                            offset=offset, data=content[offset:offset + piece],
                                            size=len(content), sha256=digest))
    return chunks


@pytest.fixture(scope="module")
def tokenizer_files(tokenizer, tmp_path_factory) -> dict[str, bytes]:
    """The tiny target's tokenizer as an honest server sends it."""
    folder = tmp_path_factory.mktemp("honest-tokenizer")
    tokenizer.save_pretrained(folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
async def hostile():
    """hostile(fingerprint, files, model_id=, refusal=) -> the address of a fake server sending
    them: a dict of files, streamed honestly, or the very chunks to send (refusal: GetTokenizer
    fails with this text instead)."""
    servers = []

    async def start(fingerprint: str, files: dict[str, bytes] | list[pb.TokenizerChunk],
                    model_id: str = "../../model", refusal: str = "") -> str:
        server = grpc.aio.server()   # gRPC's default limits: every chunk fits them
        info = pb.ModelInfo(model_id=model_id, vocab_size=320, tokenizer_fingerprint=fingerprint,
                            eos_token_ids=[2], context_length=1024)
        sent = chunked(fingerprint, files) if isinstance(files, dict) else files
        pb_grpc.add_VerifierServicer_to_server(HostileVerifier(info, sent, refusal), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(grace=0)


def cases(tmp: Path, honest: dict[str, bytes], fingerprint: str) -> dict[str, tuple[str, dict | list]]:
    """name -> (fingerprint, files or chunks) a hostile server sends."""
    tokenizer_json = honest["tokenizer.json"]
    return {**file_cases(tmp, honest, fingerprint, tokenizer_json),
            **chunk_cases(honest, fingerprint)}


def file_cases(tmp: Path, honest: dict[str, bytes], fingerprint: str,
               tokenizer_json: bytes) -> dict[str, tuple[str, dict]]:
    """Hostile fingerprints, names, sizes and contents, each streamed in honest chunks."""
    return {
        "absolute fingerprint": (str(tmp / "x"), honest),
        "parent fingerprint": ("../../etc", honest),
        "long fingerprint": ("sha256:" + "ab" * 50_000, honest),
        "parent file name": (fingerprint, {**honest, "../../escaped.json": b"{}"}),
        "folder file name": (fingerprint, {**honest, "sub/tokenizer.json": tokenizer_json}),
        "absolute file name": (fingerprint, {**honest, str(tmp / "abs.json"): b"{}"}),
        "unknown file name": (fingerprint, {**honest, "evil.py": b"print('hi')"}),
        "huge file": (fingerprint, {**honest, "added_tokens.json": b" " * (MAX_TOKENIZER_BYTES + 1)}),
        "another tokenizer": (fingerprint, {"tokenizer.json": tokenizer_json.replace(b'"def"', b'"fed"')}),
    }


def grown(chunk: pb.TokenizerChunk, more: int) -> pb.TokenizerChunk:
    """The chunk of a file that claims MORE bytes than it has."""
    lying = pb.TokenizerChunk()
    lying.CopyFrom(chunk)
    lying.size += more
    return lying


def digest_of(chunk: pb.TokenizerChunk, sha256: str) -> pb.TokenizerChunk:
    """The chunk of a file that claims another sha256."""
    lying = pb.TokenizerChunk()
    lying.CopyFrom(chunk)
    lying.sha256 = sha256
    return lying


def chunk_cases(honest: dict[str, bytes], fingerprint: str) -> dict[str, tuple[str, list]]:
    """Honest files in dishonest chunks: each breaks one rule of the GetTokenizer stream."""
    honest_chunks = chunked(fingerprint, honest)
    i, j = [n for n, c in enumerate(honest_chunks) if c.name == "tokenizer.json"][:2]
    first, second = honest_chunks[i], honest_chunks[j]     # tokenizer.json's first two chunks
    other = next(c for c in honest_chunks if c.name != first.name)

    def stream(**changes) -> list[pb.TokenizerChunk]:
        """The honest stream with CHANGES made: first= / second= {field: value} for those chunks."""
        chunks = chunked(fingerprint, honest)
        for which, fields in changes.items():
            for field, value in fields.items():
                setattr(chunks[{"first": i, "second": j}[which]], field, value)
        return chunks

    big = b"x" * (MAX_TOKENIZER_CHUNK_BYTES + 1)
    # two files, each well under the bound, that together declare more than it
    part = b" " * (MAX_TOKENIZER_BYTES * 5 // 8)
    too_much = chunked(fingerprint, {"vocab.json": part, "merges.txt": part},
                       piece=MAX_TOKENIZER_CHUNK_BYTES)
    oversize = pb.TokenizerChunk(tokenizer_fingerprint=fingerprint, name="added_tokens.json", data=big,
                                 size=len(big), sha256=hashlib.sha256(big).hexdigest())
    return {
        "bad offset": (fingerprint, stream(second={"offset": second.offset + 1})),
        "chunks out of order": (fingerprint, [*honest_chunks[:i], second, first, *honest_chunks[j + 1:]]),
        "oversize chunk": (fingerprint, [oversize, *honest_chunks]),
        "wrong sha256": (fingerprint, [digest_of(c, "0" * 64) if c.name == first.name else c
                                       for c in honest_chunks]),
        "size lie, short": (fingerprint, stream(first={"size": len(first.data) - 1})),
        "size lie, long": (fingerprint, [grown(c, 100) if c.name == first.name else c
                                         for c in honest_chunks]),
        "size changed between chunks": (fingerprint, stream(second={"size": first.size + 1})),
        "another file before the end": (fingerprint, [*honest_chunks[:j], other, *honest_chunks[j:]]),
        "a file twice": (fingerprint, [*honest_chunks, *honest_chunks]),
        "a chunk of another fingerprint": (fingerprint, stream(second={"tokenizer_fingerprint":
                                                                       "sha256:" + "1" * 64})),
        "no fingerprint on the chunks": (fingerprint, chunked("", honest)),
        "malformed sha256": (fingerprint, stream(first={"sha256": "../../x"})),
        "empty chunk": (fingerprint, stream(second={"data": b""})),
        "no files": (fingerprint, []),
        "files too big together": (fingerprint, too_much),
    }


# what each broken stream is refused for (TokenizerRefused's message)
CHUNK_RULES = {
    "bad offset": "out of order", "chunks out of order": "out of order",
    "oversize chunk": "chunk of 1048577 bytes", "wrong sha256": "do not match its sha256",
    "size lie, short": "more of tokenizer.json than its size",
    "size lie, long": "before tokenizer.json was complete|inside tokenizer.json",
    "size changed between chunks": "changed the size",
    "another file before the end": "before tokenizer.json was complete",
    "a file twice": "twice", "a chunk of another fingerprint": "another fingerprint",
    "no fingerprint on the chunks": "another fingerprint", "malformed sha256": "malformed sha256",
    "empty chunk": "empty chunk", "no files": "no tokenizer files",
    "files too big together": f"bytes of tokenizer files \\(at most {MAX_TOKENIZER_BYTES}\\)",
}


def test_each_broken_stream_is_refused_for_the_rule_it_breaks(tokenizer, tokenizer_files):
    """Every chunk case fails on its own rule (not by accident on another), before the files
    are ever written; the honest stream of the same files passes."""
    fingerprint = fingerprint_tokenizer(tokenizer)
    broken = chunk_cases(tokenizer_files, fingerprint)
    assert set(broken) == set(CHUNK_RULES)
    for name, (sent_fingerprint, chunks) in broken.items():
        received = TokenizerChunks(sent_fingerprint, "server:1")
        with pytest.raises(TokenizerRefused, match=CHUNK_RULES[name]) as refused:
            for chunk in chunks:
                received.add(chunk)
            received.files()
        assert str(refused.value).startswith("the server at server:1 ") and "\n" not in str(refused.value)
        if name == "files too big together":   # at the second file's first chunk, none of it kept
            assert (chunk.name, chunk.offset) == ("merges.txt", 0)
            assert "merges.txt" not in received.done and received.current is None
    received = TokenizerChunks(fingerprint, "server:1")
    for chunk in chunked(fingerprint, tokenizer_files):
        received.add(chunk)
    assert received.files() == tokenizer_files


# the command's own runs (a child process each): one per kind of hostility; the daemon gets all
CLI_CASES = ("absolute fingerprint", "absolute file name", "unknown file name", "huge file",
             "oversize chunk", "wrong sha256", "files too big together")


def outside_cache(tmp: Path, cache: Path) -> list[Path]:
    """Every path under tmp that is neither the cache, inside it, nor one of its parents."""
    return [p for p in tmp.rglob("*") if p != cache and cache not in p.parents and p not in cache.parents]


async def sled_generate(address: str, cache: Path, cwd: Path) -> tuple[int, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sled_cli.main", "generate", "--server", address, "--prompt", "def",
        "--max-new-tokens", "4", stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
        env={**os.environ, "SLED_CACHE": str(cache),
             "PYTHONPATH": os.pathsep.join(sys.path)})
    _, err = await asyncio.wait_for(child.communicate(), 120)
    return child.returncode, err.decode()


async def test_sled_generate_refuses_a_hostile_server_with_one_line(hostile, tokenizer, tokenizer_files,
                                                                     tmp_path):
    """`sled generate` against hostile replies, in parallel: each fails with one line, nonzero."""
    tmp = tmp_path / "device"
    cache, cwd = tmp / "cache", tmp / "cwd" / "a" / "b"
    cwd.mkdir(parents=True)
    chosen = {name: case for name, case in cases(tmp, tokenizer_files, fingerprint_tokenizer(tokenizer)).items()
              if name in CLI_CASES}
    addresses = {name: await hostile(*case) for name, case in chosen.items()}
    results = await asyncio.gather(*(sled_generate(a, cache, cwd) for a in addresses.values()))
    for name, (code, err) in zip(addresses, results):
        assert code != 0, f"{name}: exit 0"
        assert "Traceback" not in err, f"{name}: {err}"
        lines = [line for line in err.splitlines() if line.startswith("sled generate:")]
        assert len(lines) == 1 and addresses[name] in lines[0], f"{name}: {err}"
        print(name, "->", lines[0])
    assert outside_cache(tmp, cache) == [tmp / "cwd", tmp / "cwd" / "a", cwd]
    assert not any(p.is_file() and p.suffix == ".py" for p in cache.rglob("*"))
    assert not list((cache / "tokenizers").iterdir())    # nothing refused is kept


async def test_the_daemon_waits_with_one_line_and_writes_nothing_outside_its_cache(
        hostile, tokenizer, tokenizer_files, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SLED_CACHE", str(cache))
    for name, case in cases(tmp_path, tokenizer_files, fingerprint_tokenizer(tokenizer)).items():
        address = await hostile(*case)
        device = Device(DeviceSettings(id="hostile-test", servers=[address], drafter="ngram"))
        await device.start()
        try:
            assert device.state == "waiting" and not device.ready, name
            assert address in device.reason and "\n" not in device.reason, (name, device.reason)
        finally:
            await device.close()
    assert outside_cache(tmp_path, cache) == []


async def test_a_cache_that_cannot_be_written_is_one_line(hostile, tokenizer, tokenizer_files, tmp_path,
                                                          monkeypatch):
    """SLED_CACHE under a regular file (mkdir fails even as root): `sled generate` and the daemon
    each say so in one line naming the folder, with no traceback."""
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" / "cache"
    address = await hostile(fingerprint_tokenizer(tokenizer), tokenizer_files)
    code, err = await sled_generate(address, cache, tmp_path)
    assert code != 0 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("sled generate:")]
    assert len(lines) == 1 and str(cache / "tokenizers") in lines[0], err

    monkeypatch.setenv("SLED_CACHE", str(cache))
    device = Device(DeviceSettings(id="read-only-cache", servers=[address], drafter="ngram"))
    await device.start()
    try:
        assert device.state == "waiting" and str(cache / "tokenizers") in device.reason, device.reason
    finally:
        await device.close()


FORGED = "\x1b[2J\x1b[31mfake\nINFO forged line" + "x" * 5000   # clears a terminal, forges a line


async def test_the_server_s_words_reach_the_terminal_escaped_and_bounded(hostile, tokenizer, tokenizer_files,
                                                                         tmp_path, monkeypatch):
    """A refusal's details and the model name: one line, no escape sequence, at most a few hundred
    characters, in `sled generate`'s message and in the daemon's state and status."""
    fingerprint = fingerprint_tokenizer(tokenizer)
    refusing = await hostile(fingerprint, tokenizer_files, refusal=FORGED)
    code, err = await sled_generate(refusing, tmp_path / "cache", tmp_path)
    assert code != 0 and "\x1b" not in err and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("sled generate:")]
    assert len(lines) == 1 and "\\x1b[2J" in lines[0] and len(lines[0]) < 500, err

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))
    for address in (refusing, await hostile(fingerprint, tokenizer_files, model_id=FORGED)):
        device = Device(DeviceSettings(id="escaped", servers=[address], drafter="ngram"))
        await device.start()
        try:
            shown = json.dumps(device.status(), ensure_ascii=False)
            assert shown.isprintable() and len(shown) < 5000, shown
        finally:
            await device.close()
