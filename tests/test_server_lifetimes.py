"""What a session, a refusal and a call leave behind on the server: a refused request is freed,
every session holding a slot idles out, GetTokenizer costs no work per call, the receive limit
follows the context, undecodable bytes get INVALID_ARGUMENT, the model is named without the
server's paths, and a second server on a used port fails.

Raw channels (identity serializers) are used where the test must control the bytes on the wire.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import time
import types

import grpc
import pytest

from conftest import greedy_reference, run_sled
from edge_client.transport import half_close
from lab.tiny import make_tokenizer
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from verify_server.server import start_server
from verify_server.session import Session
from verify_server.errors import SessionError
from verify_server.settings import ServerSettings
from verify_server.target import Target, public_name, serialize_tokenizer
from verify_server.validation import MAX_STOP_IDS, TEXT_LIMITS, check_open

Reason = pb.ErrorDetail.Reason
GENERATE = "/sled.v1.Verifier/Generate"
A = 5                       # a valid id of the tiny vocabulary (one byte on the wire)
BIG_PROMPT = 2_000_000      # ids: ~8 MiB per request once decoded
WARM_UP, MEASURED = 30, 30  # refusals
CORRUPT = [b"\x0a\x64abc",                   # field 1, 100 bytes announced, 3 sent
           b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",   # a tag longer than any varint
           b"\x12\x05\x08\xff\xff\xff"]     # a draft whose round varint never ends


def rss_bytes() -> int:
    """The process's resident memory, after the C heap gives back what it can."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


FINGERPRINT = fingerprint_tokenizer(make_tokenizer())    # the tiny target's tokenizer


def open_bytes(prompt_len: int, max_new_tokens: int = 1, ids: int = A) -> bytes:
    return pb.DeviceMessage(open=pb.Open(prompt_ids=[ids] * prompt_len,
                                         max_new_tokens=max_new_tokens)).SerializeToString()


def open_msg(prompt, max_new_tokens: int) -> pb.DeviceMessage:
    return pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                                         ignore_eos=True, tokenizer_fingerprint=FINGERPRINT))


def draft_msg(round: int, tokens) -> pb.DeviceMessage:
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=list(tokens)))


def pinned() -> list[str]:
    """Frames still alive that hold a request, a session or a prompt: after a call has ended,
    only something keeping its exception (and so its frames) would hold them."""
    gc.collect()
    held = []
    for frame in [o for o in gc.get_objects() if isinstance(o, types.FrameType)]:
        for name, value in frame.f_locals.items():
            if (isinstance(value, (pb.DeviceMessage, pb.Open, pb.Draft, Session))
                    or type(value).__name__.startswith("RepeatedScalar")):
                held.append(f"{frame.f_code.co_name}:{name}")
    return held


async def wait_until(predicate, what: str, timeout: float = 5.0) -> float:
    """Seconds until predicate() holds."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
async def wire(serve, models):
    """wire(**settings) -> (server, raw Generate, stub-like channel): bytes in, messages out."""
    channels = []

    async def start(**settings):
        server = await serve(models["llama"], **settings)
        channel = grpc.aio.insecure_channel(server.address)
        channels.append(channel)
        raw = channel.stream_stream(GENERATE, request_serializer=lambda b: b,
                                    response_deserializer=pb.ServerMessage.FromString)
        return server, raw, channel

    yield start
    for channel in channels:
        await channel.close()


async def refused(call, code: grpc.StatusCode, reason: int) -> str:
    """The stream's last message is an ErrorDetail with `reason`, then it ends with `code`."""
    reply = await call.read()
    assert reply is not grpc.aio.EOF and reply.WhichOneof("kind") == "error", reply
    assert Reason.Name(reply.error.reason) == Reason.Name(reason), reply.error.message
    await half_close(call)              # as a device does: the status follows at once
    assert await call.code() == code
    return reply.error.message


async def served_correctly(raw, models, prompt, n: int = 4) -> None:
    """A new stream's greedy tokens are the target's own."""
    expected = greedy_reference(models["llama"], prompt, n)
    call = raw()
    await call.write(open_msg(prompt, n).SerializeToString())
    assert (await call.read()).WhichOneof("kind") == "opened"
    await call.write(draft_msg(0, expected[:n - 1]).SerializeToString())
    verdict = (await call.read()).verdict
    assert list(verdict.emitted_ids) == expected
    assert verdict.finish_reason == pb.FINISH_REASON_LENGTH
    call.cancel()


# --- refusals free their request -----------------------------------------------------------------

async def test_refused_prompts_are_freed(wire, prompts, models):
    """Refused multi-million-token prompts: no frame keeps one, and the server's RSS stops
    growing once grpc and the allocator have their working set."""
    server, raw, _ = await wire(context_length=64, max_message_bytes=64 << 20)
    big = open_bytes(BIG_PROMPT)

    async def refuse(n: int) -> None:
        for _ in range(n):
            call = raw()
            await call.write(big)
            await refused(call, grpc.StatusCode.INVALID_ARGUMENT, Reason.REASON_CONTEXT_OVERFLOW)

    await refuse(WARM_UP)   # grpc's buffers and the allocator's heap reach their working size
    assert pinned() == []
    before = rss_bytes()
    await refuse(MEASURED)
    grown_mib = (rss_bytes() - before) / (1 << 20)
    assert pinned() == []
    kept_mib = MEASURED * BIG_PROMPT * 4 / (1 << 20)   # the decoded prompts, were they kept
    print(f"RSS grew {grown_mib:.0f} MiB over {MEASURED} refusals")
    assert grown_mib < kept_mib / 4, f"RSS grew {grown_mib:.0f} MiB over {MEASURED} refusals"
    await served_correctly(raw, models, prompts[0])


async def test_refused_drafts_free_their_session(wire, prompts, models):
    """A refusal mid-session (a draft for the wrong round) leaves no frame holding the session."""
    server, raw, _ = await wire()
    for round in (3, 7):
        call = raw()
        await call.write(open_msg(prompts[0], 4).SerializeToString())
        assert (await call.read()).WhichOneof("kind") == "opened"
        await call.write(draft_msg(round, [A]).SerializeToString())
        await refused(call, grpc.StatusCode.FAILED_PRECONDITION, Reason.REASON_WRONG_ROUND)
    await wait_until(lambda: not server.service.core.sessions, "the refused sessions to go")
    assert pinned() == []
    await served_correctly(raw, models, prompts[0])


# --- every session holding a slot idles out ------------------------------------------------------

async def test_finished_sessions_with_open_streams_idle_out(wire, prompts, models):
    """One-token generations that never close their streams give their slots back after the
    idle timeout, and the next client generates the target's tokens."""
    server, raw, _ = await wire(max_sessions=3, idle_timeout=0.5)
    idle = []
    for prompt in prompts[:3]:
        call = raw()
        await call.write(open_msg(prompt, 1).SerializeToString())
        assert (await call.read()).WhichOneof("kind") == "opened"
        await call.write(draft_msg(0, [A]).SerializeToString())
        assert (await call.read()).verdict.finish_reason == pb.FINISH_REASON_LENGTH
        idle.append(call)       # finished, stream left open
    locked_out = raw()
    await locked_out.write(open_msg(prompts[3], 4).SerializeToString())
    await refused(locked_out, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REASON_TOO_MANY_SESSIONS)

    await wait_until(lambda: not server.service.core.sessions, "the finished sessions to idle out")
    assert server.metrics.value("sled_evicted_sessions_total") == 3
    await served_correctly(raw, models, prompts[3])
    for call in idle:           # the server ended each finished stream, cleanly, unasked
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


def kv_free(server) -> bool:
    pool = server.service.core.pool
    return pool.committed_blocks == 0 and pool.held_tokens == 0 and not server.scheduler._queue


async def test_an_idle_live_session_has_its_stream_ended(wire, prompts, models):
    """A session that waits on its device past the timeout: its KV goes at once, and after the
    grace in which a returning device would hear why on its next draft, the server ends the
    stream with REASON_EVICTED (the device sends nothing), keeping nothing of the session."""
    server, raw, _ = await wire(idle_timeout=0.3)
    call = raw()
    await call.write(open_msg(prompts[0], 8).SerializeToString())
    assert (await call.read()).WhichOneof("kind") == "opened"
    reply = await asyncio.wait_for(call.read(), 5)
    assert reply.error.reason == Reason.REASON_EVICTED, reply
    assert "was idle" in reply.error.message
    assert await call.code() == grpc.StatusCode.ABORTED
    assert not server.service.core.sessions and kv_free(server)
    await wait_until(lambda: not pinned(), "the evicted session's handler to let it go")
    await served_correctly(raw, models, prompts[0])


async def test_a_server_mode_reader_that_stops_reading_idles_out(wire, prompts, models):
    """Server mode: a device that reads its first message and nothing after fills the stream's
    window; its session is still evicted after the timeout and its KV freed."""
    server, raw, _ = await wire(idle_timeout=0.3)
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    channel = grpc.aio.insecure_channel(server.address, options=small_window)
    call = channel.stream_stream(GENERATE, request_serializer=lambda b: b,
                                 response_deserializer=pb.ServerMessage.FromString)()
    opening = pb.Open(prompt_ids=list(prompts[0]), ignore_eos=True,
                      max_new_tokens=1000 - len(prompts[0]), mode=pb.GENERATION_MODE_SERVER)
    await call.write(pb.DeviceMessage(open=opening).SerializeToString())
    assert (await call.read()).WhichOneof("kind") == "opened"
    await wait_until(lambda: server.metrics.value("sled_evicted_sessions_total") == 1,
                     "the stalled session to be evicted", timeout=30)
    await wait_until(lambda: not server.service.core.sessions and kv_free(server), "its KV to go")
    call.cancel()
    await channel.close()
    await served_correctly(raw, models, prompts[0])


# --- GetTokenizer and the receive limit ----------------------------------------------------------

async def test_get_tokenizer_does_no_work_per_call(serve, models, tokenizer, prompts, monkeypatch):
    """The files are made when the target is; a call neither writes nor reads the disk and
    returns at once, so a flood of them leaves other sessions' rounds alone."""
    expected = serialize_tokenizer(tokenizer)
    server = await serve(models["llama"])

    def no_disk(*args, **kwargs):
        raise AssertionError("GetTokenizer serialized the tokenizer")
    monkeypatch.setattr(server.service.core.target.tokenizer, "save_pretrained", no_disk)
    service = server.service
    held = HeldCall(), HeldCall()
    first = await written(service, held[0])
    wire = await written(service, held[1])
    assert all(isinstance(chunk, bytes) for chunk in wire)
    # encoded once, at start: every call writes the very same bytes objects
    assert len(wire) == len(first) and all(a is b for a, b in zip(wire, first))
    replies = [pb.TokenizerChunk.FromString(chunk) for chunk in wire]
    assert files_of(replies) == expected
    assert {r.tokenizer_fingerprint for r in replies} == {service.core.target.fingerprint}

    for call in held:       # over: they count against the host no more
        call.done()
    async with grpc.aio.insecure_channel(server.address) as channel:
        get = channel.unary_stream("/sled.v1.Verifier/GetTokenizer",
                                   request_serializer=pb.GetTokenizerRequest.SerializeToString,
                                   response_deserializer=pb.TokenizerChunk.FromString)
        # as many at once as the server sends one host without a token (more would be refused,
        # RESOURCE_EXHAUSTED, whenever the first ones are not yet over)
        settings = server.service.core.settings
        calls = min(settings.max_tokenizer_calls, settings.max_tokenizer_calls_per_host)
        replies = await asyncio.gather(*[chunks_of(get(pb.GetTokenizerRequest()))
                                         for _ in range(calls)])
    assert all(files_of(r) == expected for r in replies)
    await wait_until(lambda: service.core.ledger.tokenizer_calls == 0, "the calls to be counted done")


async def chunks_of(stream) -> list:
    return [chunk async for chunk in stream]


async def written(service, call: "HeldCall") -> list[bytes]:
    """What a GetTokenizer call wrote, once its handler returned."""
    await service.GetTokenizer(pb.GetTokenizerRequest(), call)
    return call.written


def files_of(chunks) -> dict[str, bytes]:
    """The files of a GetTokenizer stream, by name."""
    files: dict[str, bytes] = {}
    for chunk in chunks:
        files[chunk.name] = files.get(chunk.name, b"") + chunk.data
    return files


class HeldCall:
    """A servicer context whose call is not done until done() (its reply still being sent);
    hold_after: its client reads that many chunks, then nothing until `release` is set."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.code, self.details, self.callbacks = None, "", []
        self.written: list[bytes] = []
        self.hold_after, self.release = hold_after, asyncio.Event()

    async def write(self, chunk: bytes) -> None:
        if self.hold_after is not None and len(self.written) >= self.hold_after:
            await self.release.wait()
        self.written.append(chunk)

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        return ()          # no token: the servers here ask for none

    def auth_context(self) -> dict:
        return {}          # plaintext

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def done(self) -> None:
        for callback in self.callbacks:
            callback(self)


async def test_get_tokenizer_calls_in_flight_are_bounded(serve, models):
    """Past max_tokenizer_calls replies not yet sent, a call gets RESOURCE_EXHAUSTED at once;
    once one is done, the next is served."""
    server = await serve(models["llama"], max_tokenizer_calls=1)
    service = server.service
    held, refused_call, later = HeldCall(hold_after=1), HeldCall(), HeldCall()
    holding = asyncio.create_task(service.GetTokenizer(pb.GetTokenizerRequest(), held))
    await wait_until(lambda: len(held.written) == 1, "the first chunk")   # the rest not read
    assert await written(service, refused_call) == []
    assert refused_call.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 1" in refused_call.details and not refused_call.callbacks
    held.release.set()
    await holding
    held.done()
    assert tuple(await written(service, later)) == service.core.target.tokenizer_reply
    later.done()
    assert service.core.ledger.tokenizer_calls == 0
    async with grpc.aio.insecure_channel(server.address) as channel:   # done over the wire too
        get = channel.unary_stream("/sled.v1.Verifier/GetTokenizer",
                                   request_serializer=pb.GetTokenizerRequest.SerializeToString,
                                   response_deserializer=pb.TokenizerChunk.FromString)
        for _ in range(3):
            assert files_of(await chunks_of(get(pb.GetTokenizerRequest())))
    await wait_until(lambda: service.core.ledger.tokenizer_calls == 0,
                     "the wire calls to be counted done")


WIDE = 1 << 31             # an id whose varint takes 5 bytes, as in a vocabulary of 2^31 ids
WIDE_CHAR = "\U0001F600"   # 4 bytes in UTF-8: a string of n of them is as long as allowed


def largest_open(context_length: int) -> pb.DeviceMessage:
    """The longest Open the server accepts (for a large enough vocabulary): a prompt filling the
    context but one token, every stop id allowed, every field set, every string at its limit."""
    text = {field.split(".")[-1]: WIDE_CHAR * limit for field, limit in TEXT_LIMITS.items()}
    return pb.DeviceMessage(open=pb.Open(
        prompt_ids=[WIDE] * (context_length - 1), max_new_tokens=1,
        stop_ids=[WIDE] * MAX_STOP_IDS, ignore_eos=True, mode=pb.GENERATION_MODE_SERVER_SAT,
        sampling=pb.SamplingParams(temperature=1e30, top_k=WIDE, top_p=0.5, seed=(1 << 64) - 1),
        **text))


def largest_draft(settings: ServerSettings) -> pb.DeviceMessage:
    """The longest Draft: max_draft_tokens tokens, each with a q of max_q_support entries."""
    q = pb.SparseDistribution(ids=[WIDE] * settings.max_q_support,
                              probs=[1 / settings.max_q_support] * settings.max_q_support)
    return pb.DeviceMessage(draft=pb.Draft(
        round=WIDE, token_ids=[WIDE] * settings.max_draft_tokens, q=[q] * settings.max_draft_tokens,
        deadline_ms=WIDE, lookahead=WIDE))


def open_of_size(size: int) -> bytes:
    """An Open of exactly `size` bytes on the wire (one-byte ids, one two-byte id if needed)."""
    for n in range(size - 12, size):
        for wide in (0, 1):
            message = pb.DeviceMessage(open=pb.Open(prompt_ids=[A] * (n - wide) + [200] * wide,
                                                    max_new_tokens=1))
            if message.ByteSize() == size:
                return message.SerializeToString()
    raise AssertionError(f"no Open of {size} bytes")


async def test_receive_limit_follows_the_context(wire, prompts, models):
    """By default the server reads the longest valid message, and refuses a byte more unread."""
    settings = ServerSettings()
    limit = settings.receive_limit(64)
    assert limit < 4 << 20 < settings.receive_limit(1_000_000)   # not gRPC's fixed 4 MiB
    assert largest_open(64).ByteSize() <= limit
    assert largest_draft(settings).ByteSize() <= limit
    assert ServerSettings(max_message_bytes="1MiB").receive_limit(64) == 1 << 20
    server, raw, _ = await wire(context_length=64)
    for largest in (largest_open(64), largest_draft(settings)):   # read, then refused precisely
        call = raw()
        await call.write(largest.SerializeToString())
        reply = await call.read()
        assert reply.WhichOneof("kind") == "error", reply
        assert await call.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
    call = raw()                # exactly the limit: read, refused for its length
    await call.write(open_of_size(limit))
    await refused(call, grpc.StatusCode.INVALID_ARGUMENT, Reason.REASON_CONTEXT_OVERFLOW)
    call = raw()                # a byte more: grpc refuses it unread
    await call.write(open_of_size(limit + 1))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await served_correctly(raw, models, prompts[0])


def test_stop_ids_are_bounded(models, tokenizer):
    target = Target.from_model(models["llama"], tokenizer, "tiny")
    request = pb.Open(prompt_ids=[A], max_new_tokens=1, stop_ids=[A] * (MAX_STOP_IDS + 1))
    with pytest.raises(SessionError, match=f"at most {MAX_STOP_IDS}"):
        check_open(request, target, ServerSettings(), 0, True)


# --- undecodable bytes ---------------------------------------------------------------------------

async def test_undecodable_messages_are_invalid_argument(wire, prompts, models):
    server, raw, channel = await wire()
    for frame in CORRUPT:
        with pytest.raises(Exception):
            pb.DeviceMessage.FromString(frame)
        call = raw()
        await call.write(frame)
        details = await refused(call, grpc.StatusCode.INVALID_ARGUMENT, Reason.REASON_PROTOCOL)
        assert "not a valid sled.v1.DeviceMessage" in details
    for method in ("GetModelInfo", "GetTokenizer"):
        unary = channel.unary_unary(f"/sled.v1.Verifier/{method}",
                                    request_serializer=lambda b: b, response_deserializer=bytes)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await unary(CORRUPT[0])
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable" in exc.value.details()
    assert not server.service.core.sessions
    await served_correctly(raw, models, prompts[0])


# --- what the server tells and where it listens --------------------------------------------------

def test_public_name_never_shows_a_path(tmp_path):
    folder = tmp_path / "my-target"
    folder.mkdir()
    assert public_name(str(folder)) == "my-target"
    assert public_name(str(folder) + "/") == "my-target"
    assert public_name(str(tmp_path / "gone" / "model-x")) == "model-x"
    assert public_name("~/models/tiny-gemma") == "tiny-gemma"
    assert public_name("google/gemma-3-270m") == "google/gemma-3-270m"   # a hub id, as given
    assert public_name("gemma3-270m") == "gemma3-270m"                   # an alias


def test_an_operators_name_is_kept_as_given(models, tokenizer, pair):
    """--name is the operator's choice: served as given, even when it looks like a path; a
    model loaded from a folder without one is told by its folder's name only."""
    assert Target.load(str(pair[0]), name="team/model-v2").model_id == "team/model-v2"
    assert Target.load(str(pair[0]), name="./exactly this").model_id == "./exactly this"
    assert Target.load(str(pair[0])).model_id == pair[0].name


async def test_model_info_names_a_folder_not_its_path(serve, models, tokenizer, pair):
    server = await serve(models["llama"], model_id=str(pair[0]))
    async with grpc.aio.insecure_channel(server.address) as channel:
        info_call = channel.unary_unary("/sled.v1.Verifier/GetModelInfo",
                                        request_serializer=pb.GetModelInfoRequest.SerializeToString,
                                        response_deserializer=pb.ModelInfo.FromString)
        info = await info_call(pb.GetModelInfoRequest())
    assert info.model_id == pair[0].name
    assert str(pair[0].parent) not in info.model_id
    assert Target.load(str(pair[0])).model_id == pair[0].name


async def test_second_server_on_a_used_port_fails(serve, models, tokenizer, pair):
    server = await serve(models["llama"])
    target = Target.from_model(models["llama"], tokenizer, "tiny")
    with pytest.raises(OSError, match=f"^port 127.0.0.1:{server.port} is in use$"):
        await start_server(target, ServerSettings(kv_budget=64 << 20), port=server.port)
    done = await asyncio.to_thread(run_sled, "serve", "--model", str(pair[0]), "--port",
                                   str(server.port), timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"sled serve: port 127.0.0.1:{server.port} is in use"), done.stderr


# --- the benchmark that measures all this ----------------------------------------------------------

def test_reliability_bench_runs(tmp_path):
    """`sled bench reliability`, cut down: its three figures come out, and a new client got in."""
    out = tmp_path / "reliability.json"
    done = run_sled("bench", "reliability", "--refusals", "3", "--prompt-len", "100000",
                    "--rounds", "3", "--burst", "2", "--slots", "2", "--idle-timeout", "0.5",
                    "--out", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results["refusals"]["refusals"] == 3
    assert results["tokenizer"]["calls"] == 2 and results["tokenizer"]["during_rounds"] >= 1
    assert results["idle_slots"]["admitted"]
    assert "RSS kept per refused prompt" in done.stdout
