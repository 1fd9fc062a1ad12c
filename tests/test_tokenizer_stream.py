"""GetTokenizer as a client built from the proto alone meets it: a stream of chunks that fits
gRPC's default 4 MiB receive limit; a client that drops the stream costs the server one log line,
never a traceback; the fingerprint is what the proto says it is, and a drafting session must send
it."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from edge_client.connection import Connection
from edge_client.session import generate
from drafters.ngram import NgramDrafter
from edge_client.wire import SessionRequest
from sled.cache import MAX_TOKENIZER_CHUNK_BYTES
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.models import converted_checkpoint
from sled.v1 import verifier_pb2 as pb
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server.dropped_replies import GRPC_LOGGER, quiet_dropped_replies
from verify_server.errors import Reason

DEFAULT_RECEIVE_LIMIT = 4 << 20     # what every gRPC client accepts unless told otherwise


@pytest.fixture(scope="module")
def big_tokenizer():
    """A word-level tokenizer whose tokenizer.json is well over 4 MiB."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"word{i:06d}-{'x' * 24}": i for i in range(3, 200_000)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture
def served(serve, models):
    """served(tokenizer, **settings) -> a running server of the tiny target with that tokenizer."""

    async def start(tokenizer, **settings):
        settings.setdefault("kv_budget", 16 << 20)
        return await serve(models["llama"], "tokenizer-stream", tokenizer=tokenizer, **settings)

    return start


async def fetch_with_default_limits(address: str) -> list[pb.TokenizerChunk]:
    """The whole stream through a plain channel: no options, gRPC's default limits."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        return [chunk async for chunk in stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=60)]


def assemble(chunks: list[pb.TokenizerChunk], folder: Path) -> dict[str, bytes]:
    """What a client built from the proto does: files in order, offsets, sizes and digests
    checked, written into FOLDER."""
    files: dict[str, bytearray] = {}
    for chunk in chunks:
        data = files.setdefault(chunk.name, bytearray())
        assert chunk.offset == len(data) and len(chunk.data) <= MAX_TOKENIZER_CHUNK_BYTES
        data += chunk.data
    for name, data in files.items():
        declared = [c for c in chunks if c.name == name]
        assert {(c.size, c.sha256) for c in declared} == {(len(data), hashlib.sha256(data).hexdigest())}
        (folder / name).write_bytes(data)
    return {name: bytes(data) for name, data in files.items()}


# --- default receive limits ---------------------------------------------------------------------

async def test_a_client_with_default_limits_fetches_a_tokenizer_over_4_mib(served, big_tokenizer,
                                                                          tmp_path, monkeypatch):
    server = await served(big_tokenizer)
    chunks = await fetch_with_default_limits(server.address)
    files = assemble(chunks, tmp_path)
    assert len(files["tokenizer.json"]) > DEFAULT_RECEIVE_LIMIT
    assert max(chunk.ByteSize() for chunk in chunks) < DEFAULT_RECEIVE_LIMIT // 2
    fingerprint = fingerprint_tokenizer(big_tokenizer)
    assert {chunk.tokenizer_fingerprint for chunk in chunks} == {fingerprint}
    assert fingerprint_tokenizer(AutoTokenizer.from_pretrained(tmp_path)) == fingerprint

    monkeypatch.setenv("SLED_CACHE", str(tmp_path / "cache"))   # the device's own client too
    async with Connection(server.address) as conn:
        assert fingerprint_tokenizer(await conn.tokenizer()) == fingerprint
    await until(lambda: server.service.core.ledger.tokenizer_calls == 0)


def builtin_folder(alias: str) -> Path:
    folder = converted_checkpoint(alias)
    if folder is None or not (folder / "tokenizer.json").exists():
        pytest.skip(f"the built-in {alias} is not prepared in the sled cache")
    return folder


@pytest.mark.slow
async def test_a_client_with_default_limits_fetches_gemma3_s_tokenizer(served, tmp_path):
    """The built-in target's real 33 MB tokenizer.json, the reply that did not fit before."""
    tokenizer = AutoTokenizer.from_pretrained(builtin_folder("gemma3-270m"))
    server = await served(tokenizer)
    files = assemble(await fetch_with_default_limits(server.address), tmp_path)
    assert len(files["tokenizer.json"]) > 7 * DEFAULT_RECEIVE_LIMIT
    assert (fingerprint_tokenizer(AutoTokenizer.from_pretrained(tmp_path))
            == server.service.core.target.fingerprint)


# --- a client that drops the stream -------------------------------------------------------------

async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def server_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("sled.server", "grpc"))]


def assert_one_line_each(caplog, dropped: int) -> None:
    """No traceback and nothing at ERROR; one INFO line per dropped stream."""
    lines = server_lines(caplog)
    assert not [r for r in lines if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in lines]
    stopped = [r for r in lines if "GetTokenizer to" in r.getMessage()]
    assert len(stopped) == dropped and all(r.levelno == logging.INFO for r in stopped), \
        [r.getMessage() for r in lines]
    assert all("\n" not in r.getMessage() for r in lines)


def lengthened(server, chunks: int = 40) -> int:
    """Make the server's stream far longer than flow control lets it send ahead of a client
    that stops reading (1 MiB chunks of filler after the files); its length."""
    filler = pb.TokenizerChunk(tokenizer_fingerprint=server.service.core.target.fingerprint,
                               name="filler", data=b"x" * MAX_TOKENIZER_CHUNK_BYTES,
                               size=chunks * MAX_TOKENIZER_CHUNK_BYTES).SerializeToString()
    server.service.core.target.tokenizer_reply += (filler,) * chunks
    return len(server.service.core.target.tokenizer_reply)


async def test_a_client_refusing_a_chunk_costs_one_log_line(served, tokenizer, caplog):
    caplog.set_level(logging.DEBUG)
    server = await served(tokenizer)
    total = lengthened(server)
    small = [("grpc.max_receive_message_length", 1000)]
    for _ in range(3):
        async with grpc.aio.insecure_channel(server.address, options=small) as channel:
            call = pb_grpc.VerifierStub(channel).GetTokenizer(pb.GetTokenizerRequest(), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await until(lambda: server.service.core.ledger.tokenizer_calls == 0)
    await asyncio.sleep(0.2)
    assert_one_line_each(caplog, dropped=3)
    assert len(await fetch_with_default_limits(server.address)) == total   # still serving


async def test_a_client_cancelling_mid_stream_costs_one_log_line(served, tokenizer, caplog):
    caplog.set_level(logging.DEBUG)
    server = await served(tokenizer, max_tokenizer_calls=1)
    total = lengthened(server)
    for how in ("cancel", "close the channel"):
        channel = grpc.aio.insecure_channel(server.address)
        call = pb_grpc.VerifierStub(channel).GetTokenizer(pb.GetTokenizerRequest(), timeout=30)
        assert (await call.read()).offset == 0
        if how == "cancel":
            call.cancel()
        await channel.close()
        await until(lambda: server.service.core.ledger.tokenizer_calls == 0)   # the slot is free again
    await asyncio.sleep(0.2)
    assert_one_line_each(caplog, dropped=2)
    stopped = [r.getMessage() for r in server_lines(caplog) if "GetTokenizer to" in r.getMessage()]
    assert all(f"of {total} chunks" in line for line in stopped), stopped
    assert len(await fetch_with_default_limits(server.address)) == total


def test_grpc_s_traceback_for_an_undelivered_reply_becomes_one_line(caplog):
    """What gRPC logs when a reply's send fails before it noticed the client leave."""
    from grpc._cython.cygrpc import ExecuteBatchError

    caplog.set_level(logging.DEBUG)
    quiet_dropped_replies()
    for method in ("/sled.v1.Verifier/Generate", "/sled.v1.Verifier/GetTokenizer"):
        try:
            raise ExecuteBatchError('Failed "execute_batch"')
        except ExecuteBatchError:
            logging.getLogger(GRPC_LOGGER).exception(
                "ExecuteBatchError raised in core by servicer method [%s]", method)
    generate_line, tokenizer_line = [r for r in caplog.records if r.name == GRPC_LOGGER]
    for record, method in ((generate_line, "Generate"), (tokenizer_line, "GetTokenizer")):
        assert record.exc_info is None and not record.exc_text
        assert method in record.getMessage() and "not delivered" in record.getMessage()
    assert generate_line.levelno == logging.INFO
    assert tokenizer_line.levelno == logging.DEBUG    # GetTokenizer's own line says it at INFO
    assert "Traceback" not in caplog.text

    caplog.clear()
    caplog.set_level(logging.INFO)     # a server logging at INFO shows no DEBUG line
    try:
        raise ExecuteBatchError('Failed "execute_batch"')
    except ExecuteBatchError:
        logging.getLogger(GRPC_LOGGER).exception(
            "ExecuteBatchError raised in core by servicer method [/sled.v1.Verifier/GetTokenizer]")
    assert not [r for r in caplog.records if r.name == GRPC_LOGGER]


# --- the fingerprint ----------------------------------------------------------------------------

def fingerprint_from_tokenizer_json(path: Path) -> str:
    """The proto's definition, with the tokenizers library alone."""
    vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    text = "".join(f"{token_id}\t{token}\n" for token, token_id in sorted(vocab.items(), key=lambda e: e[1]))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_the_proto_s_fingerprint_example():
    from sled.wire.fingerprint import fingerprint_vocab

    text = "0\ta\n1\tb\n"
    assert fingerprint_vocab({"b": 1, "a": 0}) == "sha256:" + hashlib.sha256(text.encode()).hexdigest() \
        == "sha256:a2b804b1740ccd2fc6e05d726ef2753cc62bc024e643716f632d0d01a2736de6"


@pytest.mark.parametrize("alias", [pytest.param("gemma3-270m", marks=pytest.mark.slow), "smollm2-135m"])
def test_the_fingerprint_is_computable_from_tokenizer_json_alone(alias):
    folder = builtin_folder(alias)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert fingerprint_from_tokenizer_json(folder / "tokenizer.json") == fingerprint_tokenizer(tokenizer)
    added, vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"], tokenizer.get_vocab()
    assert added and all(vocab[t["content"]] == t["id"] for t in added)   # added tokens counted


def test_the_fingerprint_of_the_tiny_tokenizer_from_its_files(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    assert fingerprint_from_tokenizer_json(tmp_path / "tokenizer.json") == fingerprint_tokenizer(tokenizer)


# --- a drafting session must send it -----------------------------------------------------------

async def open_reply(address: str, opening: pb.Open) -> tuple[pb.ServerMessage, grpc.StatusCode]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VerifierStub(channel).Generate(timeout=30)
        await call.write(pb.DeviceMessage(open=opening))
        reply = await call.read()
        if reply.WhichOneof("kind") == "opened":
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:    # a server-mode session's verdicts
                pass
        return reply, await call.code()


async def test_a_drafting_session_without_a_fingerprint_is_refused(serve, models, tokenizer, prompts):
    server = await serve(models["llama"])
    fingerprint = fingerprint_tokenizer(tokenizer)
    prompt = list(prompts[0])
    reply, code = await open_reply(server.address, pb.Open(prompt_ids=prompt, max_new_tokens=3))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert reply.error.reason == Reason.REASON_TOKENIZER_MISMATCH
    assert "tokenizer_fingerprint is empty" in reply.error.message
    assert fingerprint[:19] in reply.error.message           # what to send

    sent = pb.Open(prompt_ids=prompt, max_new_tokens=3, tokenizer_fingerprint=fingerprint)
    reply, _ = await open_reply(server.address, sent)
    assert reply.WhichOneof("kind") == "opened"
    server_mode = pb.Open(prompt_ids=prompt, max_new_tokens=3, mode=pb.GENERATION_MODE_SERVER)
    reply, code = await open_reply(server.address, server_mode)   # no drafter of the device's
    assert reply.WhichOneof("kind") == "opened" and code == grpc.StatusCode.OK


async def test_the_device_sends_the_target_s_fingerprint_for_a_drafter_without_a_tokenizer(
        serve, models, prompts):
    """An n-gram drafter has no tokenizer: it drafts the target's ids, so the session opens with
    the fingerprint of the server it asks."""
    server = await serve(models["llama"])
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(pb_grpc.VerifierStub(channel), NgramDrafter(),
                                SessionRequest(list(prompts[1]), max_new_tokens=4))
    assert len(result.token_ids) == 4


# --- a busy server --------------------------------------------------------------------------------

async def test_a_device_asks_a_busy_server_again(served, tokenizer, tmp_path, monkeypatch):
    """At its bound of GetTokenizer calls the server refuses (RESOURCE_EXHAUSTED); the device
    waits and asks again, and gets the tokenizer once the slot is free."""
    import edge_client.connection as connection

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(connection, "BUSY_PAUSE_S", 0.2)
    server = await served(tokenizer, max_tokenizer_calls=1)
    files = server.service.core.target.tokenizer_reply
    async with Connection(server.address) as conn:
        await conn.model_info()     # naming the files it will get (not the lengthened ones)
        lengthened(server)      # so that a client reading nothing holds its slot
        holder = grpc.aio.insecure_channel(server.address)
        call = pb_grpc.VerifierStub(holder).GetTokenizer(pb.GetTokenizerRequest(), timeout=30)
        assert (await call.read()).offset == 0
        fetch = asyncio.create_task(conn.tokenizer())
        await asyncio.sleep(1.0)
        assert not fetch.done()                              # refused, and asking again
        server.service.core.target.tokenizer_reply = files
        call.cancel()
        await holder.close()
        assert fingerprint_tokenizer(await asyncio.wait_for(fetch, 20)) == \
            server.service.core.target.fingerprint


async def test_a_server_busy_for_good_is_refused_after_the_retries(served, tokenizer, tmp_path,
                                                                   monkeypatch):
    import edge_client.connection as connection

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    monkeypatch.setattr(connection, "BUSY_PAUSE_S", 0.05)
    monkeypatch.setattr(connection, "BUSY_RETRIES", 2)
    server = await served(tokenizer, max_tokenizer_calls=1)
    lengthened(server)
    async with grpc.aio.insecure_channel(server.address) as holder:
        call = pb_grpc.VerifierStub(holder).GetTokenizer(pb.GetTokenizerRequest(), timeout=30)
        assert (await call.read()).offset == 0
        async with Connection(server.address) as conn:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await conn.tokenizer()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
