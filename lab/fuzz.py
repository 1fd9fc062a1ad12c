"""Generated client traffic for fuzzing a verify server, and what every stream must end with.

Every field of every message a client sends is drawn from its protobuf descriptor (so a field
added later is fuzzed too), mixed with plausible sessions (an Open, drafts for the right rounds,
q that sums to 1) so that the checks deep in a round are reached as well; then raw frames, bytes
that may not decode at all. Ids and lengths cluster around the served target's vocabulary and
the server's limits (a Wire). `exchange` sends one stream in lockstep, as a device does, and
`unclear_ending` says what is wrong with how it ended (None: a status a client can act on).
A NormalSession generates greedily beside the fuzzed streams and checks every output against
the target's. Used by tests/test_fuzz_server.py and `sled bench fuzz`.

    traffic = fuzz_traffic(Wire.of(model_info))
    @given(messages=traffic.messages)            # or traffic.frames: lists of raw frames
    ...
        ending = await exchange(stub.Generate(timeout=STREAM_TIMEOUT_S), messages)
        assert unclear_ending(ending) is None
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import lru_cache

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import event
from hypothesis import strategies as st

from drafters.ngram import NgramDrafter
from edge_client.session import generate
from edge_client.transport import half_close
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2 as pb

GENERATE = "/sled.v1.Verifier/Generate"     # the full method name in the generated stubs
STREAM_TIMEOUT_S = 30.0                     # no stream comes near it: hitting it is a hang
RSS_GROWTH_MIB = 100                        # a server that grew more over a fuzz run leaks
UNCLEAR = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@dataclass(frozen=True, slots=True)
class Wire:
    """What generated traffic aims at: the target's vocabulary and tokenizer, the server's limits."""
    vocab: int
    fingerprint: str
    context: int
    max_draft: int
    max_q: int

    @classmethod
    def of(cls, info: pb.ModelInfo) -> "Wire":
        """The wire of a served target, from its ModelInfo."""
        return cls(info.vocab_size, info.tokenizer_fingerprint, info.context_length,
                   info.limits.max_draft_tokens, info.limits.max_q_support)


@dataclass(frozen=True, slots=True)
class Traffic:
    """The strategies of fuzzed streams: message sequences, lists of raw frames, one message."""
    messages: st.SearchStrategy[list[pb.DeviceMessage]]
    frames: st.SearchStrategy[list[bytes]]
    device_message: st.SearchStrategy[pb.DeviceMessage]


def fuzz_traffic(wire: Wire) -> Traffic:
    one = device_message(wire)
    return Traffic(messages=st.one_of(plausible_session(wire), st.lists(one, max_size=5)),
                   frames=st.lists(raw_frame(wire), min_size=1, max_size=4), device_message=one)


# --- any value of any field ------------------------------------------------------------------

def unsigned(bits: int, wire: Wire) -> st.SearchStrategy[int]:
    """Small numbers (rounds, counts), in-vocabulary ids, the edges around every limit, any."""
    top = 2**bits - 1
    edges = [e for e in (wire.vocab - 1, wire.vocab, wire.context, wire.context + 1,
                         wire.max_draft + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63, top) if e <= top]
    return st.one_of(st.integers(0, 8), st.integers(0, wire.vocab + 2), st.sampled_from(edges),
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


def scalar(field: FieldDescriptor, wire: Wire) -> st.SearchStrategy:
    """Any value of a scalar field's type, numbers clustered around the wire's limits."""
    if field.type == T.TYPE_ENUM:   # known values, and unknown ones (proto3 enums are open)
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         st.integers(-2**31, 2**31 - 1))
    if field.type in (T.TYPE_UINT32, T.TYPE_FIXED32, T.TYPE_UINT64, T.TYPE_FIXED64):
        return unsigned(32 if field.type in (T.TYPE_UINT32, T.TYPE_FIXED32) else 64, wire)
    if field.type in (T.TYPE_INT32, T.TYPE_SINT32, T.TYPE_SFIXED32):
        return signed(32)
    if field.type in (T.TYPE_INT64, T.TYPE_SINT64, T.TYPE_SFIXED64):
        return signed(64)
    if field.type == T.TYPE_FLOAT:
        return st.one_of(st.floats(0, 1, width=32), st.floats(width=32))
    if field.type == T.TYPE_DOUBLE:
        return st.one_of(st.floats(0, 1), st.floats())
    if field.type == T.TYPE_BOOL:
        return st.booleans()
    return free_text(binary=field.type == T.TYPE_BYTES)


@st.composite
def any_message(draw, descriptor, wire: Wire, depth: int = 0):
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
        set_field(message, field, draw(field_value(field, wire, depth)))
    return message


def field_value(field: FieldDescriptor, wire: Wire, depth: int) -> st.SearchStrategy:
    one = (any_message(field.message_type, wire, depth + 1) if field.message_type is not None
           else scalar(field, wire))
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

def token(wire: Wire) -> st.SearchStrategy[int]:
    return st.integers(0, wire.vocab - 1)


@st.composite
def plausible_open(draw, wire: Wire):
    """An Open the server would accept (perhaps one field mutated): a short prompt, a small
    max_new_tokens, greedy or seeded sampling, the target's fingerprint."""
    sampling = draw(st.sampled_from([None, pb.SamplingParams(temperature=0.8, top_k=20, top_p=0.9,
                                                            seed=3)]))
    open_ = pb.Open(prompt_ids=draw(st.lists(token(wire), min_size=1, max_size=12)),
                    max_new_tokens=draw(st.integers(1, 12)), ignore_eos=draw(st.booleans()),
                    mode=draw(st.sampled_from([0, 0, 0, 1])), drafter="fuzz",
                    tokenizer_fingerprint=wire.fingerprint)
    if sampling is not None:
        open_.sampling.CopyFrom(sampling)
    return mutated(draw, open_, wire)


@st.composite
def sparse_q(draw, drafted: int, wire: Wire):
    """A valid q with `drafted` in its support."""
    others = [t for t in draw(st.lists(token(wire), max_size=wire.max_q - 1, unique=True))
              if t != drafted]
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=len(others) + 1, max_size=len(others) + 1))
    return pb.SparseDistribution(ids=[drafted, *others], probs=[w / sum(weights) for w in weights])


@st.composite
def plausible_draft(draw, wire: Wire, round: int | None = None, with_q: bool | None = None):
    tokens = draw(st.lists(token(wire), min_size=1, max_size=wire.max_draft))
    draft = pb.Draft(round=draw(st.integers(0, 3)) if round is None else round, token_ids=tokens)
    if draw(st.booleans()) if with_q is None else with_q:
        draft.q.extend(draw(sparse_q(t, wire)) for t in tokens)
    return mutated(draw, draft, wire)


def mutated(draw, message, wire: Wire):
    """Sometimes one field of a plausible message replaced by any value of its type."""
    fields = message.DESCRIPTOR.fields
    field = draw(st.sampled_from([None] * 2 * len(fields) + list(fields)))
    if field is not None:
        message.ClearField(field.name)
        set_field(message, field, draw(field_value(field, wire, 1)))
    return message


@lru_cache(maxsize=None)
def device_message(wire: Wire) -> st.SearchStrategy[pb.DeviceMessage]:
    """One message: a plausible Open or Draft, a Close, an empty one, or any message."""
    return st.one_of(
        plausible_open(wire).map(lambda m: pb.DeviceMessage(open=m)),
        plausible_draft(wire).map(lambda m: pb.DeviceMessage(draft=m)),
        st.just(pb.DeviceMessage(close=pb.Close())),
        st.just(pb.DeviceMessage()),
        any_message(pb.DeviceMessage.DESCRIPTOR, wire),
    )


@st.composite
def plausible_session(draw, wire: Wire):
    """An Open and drafts for rounds 0, 1, ... (with q when sampling), any message of them
    perhaps mutated, perhaps any other message in between, perhaps a Close."""
    open_ = draw(plausible_open(wire))
    sampling = open_.sampling.temperature > 0
    drafts = [draw(plausible_draft(wire, round, with_q=sampling))
              for round in range(draw(st.integers(1, 4)))]
    messages = [pb.DeviceMessage(open=open_)] + [pb.DeviceMessage(draft=d) for d in drafts]
    if draw(st.booleans()):
        messages.insert(draw(st.integers(1, len(messages))), draw(device_message(wire)))
    if draw(st.booleans()):
        messages.append(pb.DeviceMessage(close=pb.Close()))
    return messages


@st.composite
def raw_frame(draw, wire: Wire):
    """Bytes that may not decode: random, or a real message cut short, with a byte changed or
    garbage after it."""
    real = draw(device_message(wire)).SerializeToString()
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


# --- one stream, and how it ended ----------------------------------------------------------------

@dataclass(slots=True)
class Ending:
    """How one fuzzed stream went: the replies, the status and its details, how long it took,
    and how many of its frames were written before it ended."""
    replies: list[pb.ServerMessage]
    code: grpc.StatusCode
    details: str
    seconds: float
    sent: int

    def verdicts(self) -> int:
        return sum(reply.WhichOneof("kind") == "verdict" for reply in self.replies)


def raw_generate(channel: grpc.aio.Channel):
    """Generate on CHANNEL taking frames as bytes, sent as they are."""
    return channel.stream_stream(GENERATE, request_serializer=None,
                                 response_deserializer=pb.ServerMessage.FromString)


async def exchange(call, frames) -> Ending:
    """Send each frame (a DeviceMessage, or bytes on a raw_generate call) and read what it
    brings, as a device does (one message, then its reply).

    Lockstep matters: a message written after the server has ended the stream makes grpc report
    the client's own INTERNAL "Internal error from Core" instead of the server's status."""
    started = time.monotonic()
    replies: list[pb.ServerMessage] = []
    sent = 0
    for frame in frames:
        if not await send(call, frame):
            break
        sent += 1
        ended = await read_reply(call, replies)
        if not ended and server_decodes(frame, replies):
            ended = await read_reply(call, replies, until_end=True)
        if ended:
            break
    else:
        await send(call, None)   # done writing: the server ends the stream
        await read_reply(call, replies, until_end=True)
    await read_reply(call, replies, until_end=True)
    return Ending(replies, await call.code(), await call.details() or "",
                  time.monotonic() - started, sent)


async def send(call, frame) -> bool:
    try:
        await (call.done_writing() if frame is None else call.write(frame))
        return True
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return False   # the stream has ended


async def read_reply(call, replies: list, until_end: bool = False) -> bool:
    """One reply (or all, until the stream ends) into `replies`; True once the stream has ended.
    A refusal is the stream's last message: as a device does, the client half-closes on it, and
    the server then ends the call (docs/protocol.md, "Refusals")."""
    while True:
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:
            return True
        if reply is grpc.aio.EOF:
            return True
        replies.append(reply)
        if reply.WhichOneof("kind") == "error":
            await half_close(call)
            until_end = True
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


def unclear_ending(ending: Ending) -> str | None:
    """What is wrong with how a stream ended, or None for a valid reply sequence ended by OK or
    by a status a client can act on (with its message, and the service's ErrorDetail)."""
    code, details = ending.code, ending.details
    if ending.seconds >= STREAM_TIMEOUT_S:
        return "the stream hung until the client's deadline"
    kinds = [reply.WhichOneof("kind") for reply in ending.replies]
    if not all(kinds[:-1]) or "error" in kinds[:-1]:
        return f"replies out of order: {kinds}"
    if code == grpc.StatusCode.OK:
        return f"OK after an error: {ending.replies[-1]}" if "error" in kinds else None
    if code in UNCLEAR:
        return f"{code.name}: {details!r}"
    if not details.strip():
        return f"{code.name} without a message"
    if kinds and kinds[-1] == "error":   # the service's refusal: its reason, then its status
        error = ending.replies[-1].error
        if error.message != details or error.reason == pb.ErrorDetail.REASON_UNSPECIFIED:
            return f"{code.name}: an ErrorDetail that does not match: {error} vs {details!r}"
        return None
    # only grpc's own receive limit ends a stream without the service's ErrorDetail
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return None
    return f"{code.name} without the service's ErrorDetail: {details!r}"


def assert_clear_ending(ending: Ending) -> None:
    """In a hypothesis test: the ending is clear (its status is noted as an event)."""
    event(f"{ending.code.name} after {ending.verdicts()} verdicts")
    problem = unclear_ending(ending)
    assert problem is None, problem


# --- a normal session beside the fuzzed streams ---------------------------------------------------

class NormalSession:
    """A greedy device session generating again and again (an n-gram drafter) while fuzzed
    streams hit the same server; every output must be the target's greedy reference (each
    session asks for as many tokens as the reference has, so one that ends at EOS is whole)."""

    def __init__(self, stub, prompt_ids: list[int], reference: list[int]) -> None:
        self.stub, self.prompt_ids, self.reference = stub, list(prompt_ids), list(reference)
        self.sessions = self.mismatches = self.tokens = 0
        self.error: str | None = None     # what ended it early (the server went away)
        self._stopping = False
        self._task: asyncio.Task | None = None

    @property
    def lossless(self) -> bool:
        return self.sessions > 0 and self.mismatches == 0 and self.error is None

    async def once(self) -> None:
        """One whole generation, checked against the reference."""
        result = await generate(self.stub, NgramDrafter(),
                                SessionRequest(self.prompt_ids, max_new_tokens=len(self.reference)))
        self.sessions += 1
        self.tokens += len(result.token_ids)
        self.mismatches += result.token_ids != self.reference

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.once()
            except Exception as exc:     # a lost server ends it: a result to report
                self.error = f"{type(exc).__name__}: {exc}"
                return

    async def stop(self, timeout_s: float = 2 * STREAM_TIMEOUT_S) -> None:
        """Let the generation in progress finish, then stop; one still going after timeout_s
        is cancelled and is the session's error (a server that stopped answering)."""
        self._stopping = True
        if self._task is None or self._task.done():
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            await self.cancel()
            self.error = self.error or f"a generation did not finish within {timeout_s:g} s"

    async def cancel(self) -> None:
        """Stop now, dropping the generation in progress."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
