"""Property-based fuzzing of the server: whatever a client sends on a Generate stream, the stream
ends with a clear status, and the server stays clean and correct.

Every field of every message a client sends is drawn from its protobuf descriptor (so a field
added later is fuzzed too), mixed with plausible sessions (an Open, drafts for the right rounds,
q that sums to 1) so that the rounds behind the checks are reached as well; then raw frames,
bytes that may not decode at all. One in-process server of the tiny target takes every example.
After the run it must hold no session and no KV, serve the target's greedy output, and its
process must not have grown by more than RSS_GROWTH_MIB.

The examples are fixed (derandomized), so CI runs the same ones each time, well under a minute.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import greedy_reference
from drafters.ngram import NgramDrafter
from edge_client.session import generate
from lab.tiny import make_tokenizer
from sled.fingerprint import fingerprint_tokenizer
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from verify_server.server import start_server
from verify_server.settings import ServerSettings
from verify_server.target import Target

CONTEXT, MAX_DRAFT, MAX_Q = 64, 4, 4
VOCAB = len(make_tokenizer())
FINGERPRINT = fingerprint_tokenizer(make_tokenizer())   # the tiny target's: device-drafts sessions open
OPENED_SHARE = 0.2   # of the plausible sessions: fewer Opened means the deep checks went unfuzzed
GENERATE = "/sled.v1.Verifier/Generate"     # the full method name in the generated stubs
STREAM_TIMEOUT_S = 30.0                     # no example comes near it: hitting it is a hang
RSS_GROWTH_MIB = 100
UNCLEAR = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


# --- any value of any field ------------------------------------------------------------------

def unsigned(bits: int) -> st.SearchStrategy[int]:
    """Small numbers (rounds, counts), in-vocabulary ids, the edges around every limit, any."""
    top = 2**bits - 1
    edges = [e for e in (VOCAB - 1, VOCAB, CONTEXT, CONTEXT + 1, MAX_DRAFT + 1, 2**31 - 1, 2**31,
                         2**32 - 1, 2**63, top) if e <= top]
    return st.one_of(st.integers(0, 8), st.integers(0, VOCAB + 2), st.sampled_from(edges),
                     st.integers(0, top))


def signed(bits: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 8), st.integers(-2**(bits - 1), 2**(bits - 1) - 1))


def free_text(binary: bool) -> st.SearchStrategy:
    """Short text with control characters, and lengths on both sides of every text limit."""
    lengths = st.sampled_from([127, 128, 129, 255, 256, 257, 4096, 1 << 20])
    if binary:
        return st.one_of(st.binary(max_size=16), lengths.map(lambda n: b"b" * n))
    return st.one_of(st.text(max_size=16), st.sampled_from(["ngram", "a\nforged line", "\x1b[2J\x00"]),
                     lengths.map(lambda n: "t" * n))


T = FieldDescriptor
SCALARS = {
    T.TYPE_UINT32: unsigned(32), T.TYPE_FIXED32: unsigned(32),
    T.TYPE_UINT64: unsigned(64), T.TYPE_FIXED64: unsigned(64),
    T.TYPE_INT32: signed(32), T.TYPE_SINT32: signed(32), T.TYPE_SFIXED32: signed(32),
    T.TYPE_INT64: signed(64), T.TYPE_SINT64: signed(64), T.TYPE_SFIXED64: signed(64),
    T.TYPE_FLOAT: st.one_of(st.floats(0, 1, width=32), st.floats(width=32)),
    T.TYPE_DOUBLE: st.one_of(st.floats(0, 1), st.floats()),
    T.TYPE_BOOL: st.booleans(),
    T.TYPE_STRING: free_text(binary=False), T.TYPE_BYTES: free_text(binary=True),
}


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type == T.TYPE_ENUM:   # known values, and unknown ones (proto3 enums are open)
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         st.integers(-2**31, 2**31 - 1))
    return SCALARS[field.type]


@st.composite
def any_message(draw, descriptor, depth: int = 0):
    """A message of `descriptor` with a random subset of its fields set to random values (one
    member of each oneof at most)."""
    message = message_factory.GetMessageClass(descriptor)()
    chosen = {oneof.name: draw(st.sampled_from([None, *oneof.fields])) for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        if field.containing_oneof is not None:
            if chosen[field.containing_oneof.name] is not field:
                continue
        elif not draw(st.booleans()):
            continue
        set_field(message, field, draw(field_value(field, depth)))
    return message


def field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    one = (any_message(field.message_type, depth + 1) if field.message_type is not None
           else scalar(field))
    if field.is_repeated:
        return st.lists(one, max_size=3 if field.message_type is not None else 10)
    return one


def set_field(message, field: FieldDescriptor, value) -> None:
    if field.is_repeated:
        target = getattr(message, field.name)
        for item in value:
            target.add().CopyFrom(item) if field.message_type is not None else target.append(item)
    elif field.message_type is not None:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


# --- plausible sessions, so that the checks deep in a round are reached too ------------------

token = st.integers(0, VOCAB - 1)


@st.composite
def plausible_open(draw):
    sampling = draw(st.sampled_from([None, pb.SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                                            seed=3)]))
    open_ = pb.Open(prompt_ids=draw(st.lists(token, min_size=1, max_size=12)),
                    max_new_tokens=draw(st.integers(1, 12)), ignore_eos=draw(st.booleans()),
                    mode=draw(st.sampled_from([0, 0, 0, 1])), drafter="fuzz",
                    tokenizer_fingerprint=FINGERPRINT)
    if sampling is not None:
        open_.sampling.CopyFrom(sampling)
    return mutated(draw, open_)


@st.composite
def sparse_q(draw, drafted: int):
    """A valid q with `drafted` in its support."""
    others = [t for t in draw(st.lists(token, max_size=MAX_Q - 1, unique=True)) if t != drafted]
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=len(others) + 1, max_size=len(others) + 1))
    return pb.SparseDistribution(ids=[drafted, *others], probs=[w / sum(weights) for w in weights])


@st.composite
def plausible_draft(draw, round: int | None = None, with_q: bool | None = None):
    tokens = draw(st.lists(token, min_size=1, max_size=MAX_DRAFT))
    draft = pb.Draft(round=draw(st.integers(0, 3)) if round is None else round, token_ids=tokens)
    if draw(st.booleans()) if with_q is None else with_q:
        draft.q.extend(draw(sparse_q(t)) for t in tokens)
    return mutated(draw, draft)


def mutated(draw, message):
    """Sometimes one field of a plausible message replaced by any value of its type."""
    fields = message.DESCRIPTOR.fields
    field = draw(st.sampled_from([None] * 2 * len(fields) + list(fields)))
    if field is not None:
        message.ClearField(field.name)
        set_field(message, field, draw(field_value(field, 1)))
    return message


DEVICE_MESSAGE = pb.DeviceMessage.DESCRIPTOR
device_message = st.one_of(
    plausible_open().map(lambda m: pb.DeviceMessage(open=m)),
    plausible_draft().map(lambda m: pb.DeviceMessage(draft=m)),
    st.just(pb.DeviceMessage(close=pb.Close())),
    st.just(pb.DeviceMessage()),
    any_message(DEVICE_MESSAGE),
)


@st.composite
def plausible_session(draw):
    """An Open and drafts for rounds 0, 1, ... (with q when sampling), any message of them
    perhaps mutated, perhaps any other message in between, perhaps a Close."""
    open_ = draw(plausible_open())
    sampling = open_.sampling.temperature > 0
    drafts = [draw(plausible_draft(round, with_q=sampling)) for round in range(draw(st.integers(1, 4)))]
    messages = [pb.DeviceMessage(open=open_)] + [pb.DeviceMessage(draft=d) for d in drafts]
    if draw(st.booleans()):
        messages.insert(draw(st.integers(1, len(messages))), draw(device_message))
    if draw(st.booleans()):
        messages.append(pb.DeviceMessage(close=pb.Close()))
    return messages


stream_of_messages = st.one_of(plausible_session(), st.lists(device_message, max_size=5))


@st.composite
def raw_frame(draw):
    """Bytes that may not decode: random, or a real message cut short, with a byte changed or
    garbage after it."""
    real = draw(device_message).SerializeToString()
    how = draw(st.sampled_from(["random", "cut", "flip", "append", "real"]))
    if how == "random":
        return draw(st.binary(max_size=48))
    if how == "real" or not real:
        return real
    at = draw(st.integers(0, len(real) - 1))
    if how == "cut":
        return real[:at]
    if how == "flip":
        return real[:at] + bytes([real[at] ^ draw(st.integers(1, 255))]) + real[at + 1:]
    return real + draw(st.binary(min_size=1, max_size=16))


# --- the server ---------------------------------------------------------------------------------

class Fuzzed:
    """One server for the whole module, a raw channel to it, and its process's RSS at the start."""

    def __init__(self, running, channel) -> None:
        self.server = running
        self.channel = channel
        self.stub = VerifierStub(channel)
        self.raw_generate = channel.stream_stream(GENERATE, request_serializer=None,
                                                  response_deserializer=pb.ServerMessage.FromString)
        self.rss_start = psutil.Process().memory_info().rss
        self.streams = 0
        self.drafts_opens = 0      # streams that began with an Open in device-drafts mode
        self.drafts_opened = 0     # ... and got an Opened, so their drafts reached the round


@pytest.fixture(scope="module")
async def fuzzed(models, tokenizer):
    target = Target.from_model(models["llama"], tokenizer, "tiny-fuzz")
    running = await start_server(target, ServerSettings(
        context_length=CONTEXT, max_draft_len=MAX_DRAFT, max_q_support=MAX_Q, kv_budget=64 << 20))
    channel = grpc.aio.insecure_channel(running.address)
    await warm_up(VerifierStub(channel))
    yield Fuzzed(running, channel)
    await channel.close()
    await running.stop(grace=0)


async def warm_up(stub) -> None:
    """One generation before the RSS baseline, so lazy allocations are not counted as growth."""
    await generate(stub, NgramDrafter(), [5, 6, 7], max_new_tokens=4)


# --- what every stream must end with -------------------------------------------------------------

async def exchange(call, frames) -> tuple[list[pb.ServerMessage], grpc.StatusCode, str, float]:
    """Send each frame and read what it brings, as a device does (one message, then its reply);
    returns the stream's replies, status, details and how long it took.

    Lockstep matters: a message written after the server has ended the stream makes grpc report
    the client's own INTERNAL "Internal error from Core" instead of the server's status."""
    started = time.monotonic()
    replies: list[pb.ServerMessage] = []
    for frame in frames:
        if not await send(call, frame):
            break
        ended = await read_reply(call, replies)
        if not ended and server_decodes(frame, replies):
            ended = await read_reply(call, replies, until_end=True)
        if ended:
            break
    else:
        await send(call, None)   # done writing: the server ends the stream
        await read_reply(call, replies, until_end=True)
    await read_reply(call, replies, until_end=True)
    return replies, await call.code(), await call.details() or "", time.monotonic() - started


async def send(call, frame) -> bool:
    try:
        await (call.done_writing() if frame is None else call.write(frame))
        return True
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False   # the stream has ended


async def read_reply(call, replies: list, until_end: bool = False) -> bool:
    """One reply (or all, until the stream ends) into `replies`; True once the stream has ended."""
    while True:
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:
            return True
        if reply is grpc.aio.EOF:
            return True
        replies.append(reply)
        until_end = until_end or reply.WhichOneof("kind") == "error"   # the stream's last message
        if not until_end:
            return False


def server_decodes(frame, replies: list) -> bool:
    """The frame opened a session in a server mode, which streams verdicts and then ends."""
    message = frame if isinstance(frame, pb.DeviceMessage) else decoded(frame)
    return (message is not None and message.WhichOneof("kind") == "open"
            and message.open.mode != pb.GENERATION_MODE_DEVICE_DRAFTS
            and replies[-1].WhichOneof("kind") == "opened")


def decoded(frame: bytes) -> pb.DeviceMessage | None:
    try:
        return pb.DeviceMessage.FromString(frame)
    except Exception:
        return None


def assert_clear_ending(replies, code: grpc.StatusCode, details: str, seconds: float) -> None:
    """A valid reply sequence, ended by OK or by a status a client can act on."""
    event(f"{code.name} after {sum(r.WhichOneof('kind') == 'verdict' for r in replies)} verdicts")
    assert seconds < STREAM_TIMEOUT_S, "the stream hung until the client's deadline"
    kinds = [reply.WhichOneof("kind") for reply in replies]
    assert all(kinds[:-1]) and all(k != "error" for k in kinds[:-1]), kinds
    if code == grpc.StatusCode.OK:
        assert "error" not in kinds, replies[-1]
        return
    assert code not in UNCLEAR, f"{code}: {details!r}"
    assert details.strip(), f"{code} without a message"
    if kinds and kinds[-1] == "error":   # the service's refusal: its reason, then its status
        assert replies[-1].error.message == details
        assert replies[-1].error.reason != pb.ErrorDetail.REASON_UNSPECIFIED
    else:   # only grpc's own receive limit ends a stream without the service's ErrorDetail
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, \
            f"{code}: {details!r}"


async def until_clean(server, timeout: float = 5.0) -> None:
    """The stream's session, its KV and its queued work are gone (the server cleans up right
    after the stream's last message)."""
    deadline = time.monotonic() + timeout
    while not clean(server):
        assert time.monotonic() < deadline, (
            f"left behind: {len(server.service.sessions)} sessions, "
            f"{server.service.pool.committed_blocks} KV blocks")
        await asyncio.sleep(0.005)


def clean(server) -> bool:
    """No session, no KV block in use or promised, no queued work."""
    pool = server.service.pool
    return (not server.service.sessions and pool.committed_blocks == 0 and pool.held_tokens == 0
            and server.metrics.value("sled_active_sessions") == 0 and not server.scheduler._queue)


# --- the properties ---------------------------------------------------------------------------------

@FUZZ
@given(messages=stream_of_messages)
async def test_any_message_sequence_ends_clearly(fuzzed, messages):
    call = fuzzed.stub.Generate(timeout=STREAM_TIMEOUT_S)
    replies, *ending = await exchange(call, messages)
    assert_clear_ending(replies, *ending)
    await until_clean(fuzzed.server)
    fuzzed.streams += 1
    count_drafts_session(fuzzed, messages, replies)


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
@given(frames=st.lists(raw_frame(), min_size=1, max_size=4))
async def test_any_raw_frames_end_clearly(fuzzed, frames):
    # An undecodable frame must end the stream with INVALID_ARGUMENT and an ErrorDetail, not
    # with the UNKNOWN a raising decoder gives.
    call = fuzzed.raw_generate(timeout=STREAM_TIMEOUT_S)
    assert_clear_ending(*await exchange(call, frames))
    await until_clean(fuzzed.server)
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


async def test_after_the_fuzz_the_server_is_clean_and_correct(fuzzed, models, prompts):
    """Runs after the properties above (same module, same server): nothing left behind, the
    target's greedy output, and bounded growth of the process."""
    assert fuzzed.streams > 0, "no fuzzed stream ran: run this module whole, not this test alone"
    await until_clean(fuzzed.server)
    assert fuzzed.server.metrics.value("sled_kv_tokens") == 0
    for prompt in prompts[:3]:
        result = await generate(fuzzed.stub, NgramDrafter(), prompt, max_new_tokens=10)
        assert result.token_ids == greedy_reference(models["llama"], prompt, 10)
    await until_clean(fuzzed.server)
    grown_mib = (psutil.Process().memory_info().rss - fuzzed.rss_start) / (1 << 20)
    print(f"RSS grew {grown_mib:.1f} MiB over {fuzzed.streams} streams")
    assert grown_mib < RSS_GROWTH_MIB, f"RSS grew {grown_mib:.0f} MiB over {fuzzed.streams} streams"
