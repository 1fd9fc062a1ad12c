"""Property-based fuzzing of the server: whatever a client sends on a Generate stream, the stream
ends with a clear status, and the server stays up, clean and correct.

The traffic comes from lab.fuzz: every field of every message a client sends drawn from its
protobuf descriptor, plausible sessions so that the rounds behind the checks are reached, raw
frames that may not decode. One in-process server of the tiny target takes every example, while
a normal greedy session generates on it the whole time: each of its outputs must equal the
target's generate(do_sample=False). After each stream nothing of it is left (no session, KV or
queued work beyond the normal session's); after the run the server holds no session and no KV,
and its process has not grown by more than RSS_GROWTH_MIB.

The examples are fixed (derandomized), so CI runs the same ones each time, well under a minute.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import greedy_reference
from drafters.ngram import NgramDrafter
from edge_client.session import generate
from edge_client.wire import SessionRequest
from lab.fuzz import (RSS_GROWTH_MIB, STREAM_TIMEOUT_S, NormalSession, Wire, assert_clear_ending,
                      exchange, fuzz_traffic, raw_generate)
from lab.tiny import CORPUS, make_tokenizer
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from verify_server.server import start_server
from verify_server.settings import ServerSettings
from verify_server.target import Target

TINY = Wire(vocab=len(make_tokenizer()), fingerprint=fingerprint_tokenizer(make_tokenizer()),
            context=64, max_draft=4, max_q=4)   # the tiny target's: device-drafts sessions open
TRAFFIC = fuzz_traffic(TINY)
# Longer than any fuzzed prompt (12 ids at most), so its sessions are told from fuzzed ones.
NORMAL_PROMPT = make_tokenizer()(CORPUS[1]).input_ids[:24]
NORMAL_TOKENS = 24
OPENED_SHARE = 0.2   # of the plausible sessions: fewer Opened means the deep checks went unfuzzed
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


# --- the server ---------------------------------------------------------------------------------

class Fuzzed:
    """One server for the whole module, a raw channel to it, the normal session beside the
    fuzzed streams, and the process's RSS at the start."""

    def __init__(self, running, channel, normal: NormalSession) -> None:
        self.server = running
        self.channel = channel
        self.stub = VerifierStub(channel)
        self.raw_generate = raw_generate(channel)
        self.normal = normal
        self.rss_start = psutil.Process().memory_info().rss
        self.streams = 0
        self.drafts_opens = 0      # streams that began with an Open in device-drafts mode
        self.drafts_opened = 0     # ... and got an Opened, so their drafts reached the round


@pytest.fixture(scope="module")
async def fuzzed(models, tokenizer):
    target = Target.from_model(models["llama"], tokenizer, "tiny-fuzz")
    running = await start_server(target, ServerSettings(
        context_length=TINY.context, max_draft_tokens=TINY.max_draft, max_q_support=TINY.max_q,
        kv_budget=64 << 20))
    channel = grpc.aio.insecure_channel(running.address)
    normal = NormalSession(VerifierStub(channel), NORMAL_PROMPT,
                           greedy_reference(models["llama"], NORMAL_PROMPT, NORMAL_TOKENS))
    await normal.once()      # before the RSS baseline, so lazy allocations are not growth
    fuzzed = Fuzzed(running, channel, normal)
    normal.start()
    yield fuzzed
    await normal.stop()
    await channel.close()
    await running.stop(grace=0)


# --- what every stream must leave behind: nothing -------------------------------------------------

async def until_clean(server, timeout: float = 5.0, normal_beside: bool = False) -> None:
    """The stream's session, its KV and its queued work are gone (the server cleans up right
    after the stream's last message); NORMAL_BESIDE: the normal session's may stay."""
    deadline = time.monotonic() + timeout
    while (left := left_behind(server, normal_beside)) is not None:
        assert time.monotonic() < deadline, f"left behind: {left}"
        await asyncio.sleep(0.005)


def left_behind(server, normal_beside: bool) -> str | None:
    """Sessions, KV blocks or tokens, or queued work beyond what the normal session holds (all
    of it when not NORMAL_BESIDE); None when there is none."""
    sessions, pool = server.service.core.sessions, server.service.core.pool
    kept = [s for s in sessions.values() if normal_beside and s.prompt_ids == NORMAL_PROMPT]
    blocks = sum(len(s.kv.table) + s.kv.reserved_blocks for s in kept)
    tokens = sum(s.kv.length for s in kept)
    queued = [work for work in server.scheduler._queue if work.session not in kept]
    if (len(sessions) == len(kept) and pool.committed_blocks == blocks
            and pool.held_tokens == tokens and not queued
            and server.metrics.value("sled_active_sessions") == len(kept)):
        return None
    return (f"{len(sessions) - len(kept)} sessions, {pool.committed_blocks - blocks} KV blocks, "
            f"{pool.held_tokens - tokens} KV tokens, {len(queued)} queued steps")


# --- the properties ---------------------------------------------------------------------------------

@FUZZ
@given(messages=TRAFFIC.messages)
async def test_any_message_sequence_ends_clearly(fuzzed, messages):
    call = fuzzed.stub.Generate(timeout=STREAM_TIMEOUT_S)
    ending = await exchange(call, messages)
    assert_clear_ending(ending)
    await until_clean(fuzzed.server, normal_beside=True)
    fuzzed.streams += 1
    count_drafts_session(fuzzed, messages, ending.replies)


def count_drafts_session(fuzzed: Fuzzed, messages, replies) -> None:
    first = messages[0] if messages else pb.DeviceMessage()
    if first.WhichOneof("kind") == "open" and first.open.mode == pb.GENERATION_MODE_DEVICE_DRAFTS:
        fuzzed.drafts_opens += 1
        fuzzed.drafts_opened += any(r.WhichOneof("kind") == "opened" for r in replies)


async def test_the_fuzz_reached_the_rounds(fuzzed):
    """Runs after the property above: a fair share of its device-drafts sessions were opened, so
    the checks on drafts, q and rounds were fuzzed (an Open the server refuses whatever follows,
    say for a missing fingerprint, would leave them untested while every stream ends clearly)."""
    assert fuzzed.drafts_opens > 0, "no fuzzed session ran: run this module whole"
    share = fuzzed.drafts_opened / fuzzed.drafts_opens
    print(f"{fuzzed.drafts_opened} of {fuzzed.drafts_opens} device-drafts sessions opened")
    assert share >= OPENED_SHARE, (
        f"only {fuzzed.drafts_opened} of {fuzzed.drafts_opens} fuzzed device-drafts sessions "
        "got an Opened: the rounds behind them went unfuzzed")


@FUZZ
@given(frames=TRAFFIC.frames)
async def test_any_raw_frames_end_clearly(fuzzed, frames):
    # An undecodable frame must end the stream with INVALID_ARGUMENT and an ErrorDetail, not
    # with the UNKNOWN a raising decoder gives.
    call = fuzzed.raw_generate(timeout=STREAM_TIMEOUT_S)
    assert_clear_ending(await exchange(call, frames))
    await until_clean(fuzzed.server, normal_beside=True)
    fuzzed.streams += 1


UNARY = {"/sled.v1.Verifier/GetModelInfo": pb.ModelInfo, "/sled.v1.Verifier/GetTokenizer": pb.TokenizerChunk}


async def first_reply(channel, method: str, frame: bytes):
    """The reply of a call sending FRAME as its request (GetTokenizer's first chunk)."""
    decode = UNARY[method].FromString
    if UNARY[method] is pb.TokenizerChunk:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=decode)
        stream = call(frame, timeout=STREAM_TIMEOUT_S)
        try:
            return await anext(aiter(stream))
        finally:
            stream.cancel()      # the rest is not read
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=decode)
    return await call(frame, timeout=STREAM_TIMEOUT_S)


@settings(FUZZ, max_examples=100)
@given(method=st.sampled_from(sorted(UNARY)), frame=st.binary(max_size=48))
async def test_unary_calls_answer_any_frame_clearly(fuzzed, method, frame):
    """The requests without a stream have no fields, so any bytes are a frame for them: a reply,
    or INVALID_ARGUMENT for bytes that do not decode."""
    try:
        reply = await first_reply(fuzzed.channel, method, frame)
    except grpc.aio.AioRpcError as error:
        assert decoded_as(UNARY[method], frame) is None, error
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details(), error
        return
    assert decoded_as(UNARY[method], frame) is not None and reply.tokenizer_fingerprint


def decoded_as(reply_type, frame: bytes):
    request_type = pb.GetModelInfoRequest if reply_type is pb.ModelInfo else pb.GetTokenizerRequest
    try:
        return request_type.FromString(frame)
    except Exception:
        return None


async def test_the_normal_session_stayed_lossless_beside_the_fuzz(fuzzed):
    """Runs after the properties above: the normal session generated all along (more than its
    warm-up) and every output was the target's greedy output."""
    assert fuzzed.streams > 0, "no fuzzed stream ran: run this module whole, not this test alone"
    await fuzzed.normal.stop()
    normal = fuzzed.normal
    print(f"normal session: {normal.sessions} generations, {normal.tokens} tokens beside "
          f"{fuzzed.streams} fuzzed streams")
    assert normal.error is None, normal.error
    assert normal.sessions >= 3, f"only {normal.sessions} normal generations ran beside the fuzz"
    assert normal.mismatches == 0, f"{normal.mismatches} of {normal.sessions} outputs differed"


async def test_after_the_fuzz_the_server_is_clean_and_correct(fuzzed, models, prompts):
    """Runs last (same module, same server): nothing left behind, the target's greedy output,
    and bounded growth of the process."""
    assert fuzzed.streams > 0, "no fuzzed stream ran: run this module whole, not this test alone"
    await fuzzed.normal.stop()
    await until_clean(fuzzed.server)
    assert fuzzed.server.metrics.value("sled_kv_tokens") == 0
    for prompt in prompts[:3]:
        result = await generate(fuzzed.stub, NgramDrafter(),
                                SessionRequest(prompt, max_new_tokens=10))
        assert result.token_ids == greedy_reference(models["llama"], prompt, 10)
    await until_clean(fuzzed.server)
    grown_mib = (psutil.Process().memory_info().rss - fuzzed.rss_start) / (1 << 20)
    print(f"RSS grew {grown_mib:.1f} MiB over {fuzzed.streams} streams")
    assert grown_mib < RSS_GROWTH_MIB, f"RSS grew {grown_mib:.0f} MiB over {fuzzed.streams} streams"
