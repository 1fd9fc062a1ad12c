"""Bad input: every refusal has a precise gRPC status, a message a person can act on and an
ErrorDetail reason as the stream's last message; the refused stream's session is gone, and the
other sessions on the server never notice.

The raw stub is used throughout so that each test controls every message on the wire.
"""
from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from conftest import greedy_reference
from drafters.hf import HFDrafter
from drafters.ngram import NgramDrafter
from edge_client.session import RoundSettings, Target, generate
from edge_client.transport import VerifyError, half_close
from edge_client.wire import SessionRequest
from sled.wire.fingerprint import fingerprint_tokenizer, fingerprint_vocab, short
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from lab.tiny import make_tokenizer

Reason = pb.ErrorDetail.Reason
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

MODEL_ID = "tiny-llama-target"
MAX_DRAFT, CONTEXT, MAX_Q = 4, 64, 4
MAX_MESSAGE = 1024
LIMITS = dict(max_draft_tokens=MAX_DRAFT, context_length=CONTEXT, max_q_support=MAX_Q,
              max_message_bytes=MAX_MESSAGE)
OTHER_FP = fingerprint_vocab({"<other>": 0, "vocab": 1})
TARGET_FP = fingerprint_tokenizer(make_tokenizer())    # the tiny target's tokenizer
A, B, C = 5, 6, 7   # valid ids (the tiny vocabulary has a few hundred)


# --- messages ---------------------------------------------------------------------------------

def open_msg(prompt, max_new_tokens: int = 8, *, temperature: float = 0.0, top_p: float = 1.0,
             stop_ids=(), fingerprint: str | None = None, drafter: str = "raw-test",
             ignore_eos: bool = True) -> pb.DeviceMessage:
    # ignore_eos: a valid round can never end a session early, so later rounds are still live.
    # fingerprint: the target's unless given (a drafting session must send one)
    fingerprint = TARGET_FP if fingerprint is None else fingerprint
    msg = pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt), max_new_tokens=max_new_tokens,
                                        stop_ids=list(stop_ids), tokenizer_fingerprint=fingerprint,
                                        drafter=drafter, ignore_eos=ignore_eos))
    msg.open.sampling.temperature = temperature
    msg.open.sampling.top_p = top_p
    if temperature:
        msg.open.sampling.seed = 7
    return msg


def sampling_open(prompt, **kw) -> pb.DeviceMessage:
    return open_msg(prompt, temperature=0.8, **kw)


def draft_msg(round: int, tokens, q=None) -> pb.DeviceMessage:
    dists = [pb.SparseDistribution(ids=ids, probs=probs) for ids, probs in (q or ())]
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=list(tokens), q=dists))


def reason_label(reason: int) -> str:
    return Reason.Name(reason).removeprefix("REASON_").lower()


def errors_counted(server, reason: int) -> float:
    return server.metrics.value("sled_errors_total", {"reason": reason_label(reason)})


# --- the table of refusals --------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    steps: Callable[[int, list[int]], list[pb.DeviceMessage]]  # (vocab, prompt) -> messages
    code: grpc.StatusCode
    reason: int
    phrases: tuple[str, ...]      # formatted with V (vocab size), n (prompt length), model
    round: int = 0                # ErrorDetail.round


UINT32_MAX = 2**32 - 1
VALID_Q = [([A, B], [0.5, 0.5])]   # for a one-token draft [A]

CASES = [
    # out-of-vocabulary ids, wherever they appear
    Case("prompt_id_eq_vocab", lambda V, P: [open_msg([*P, V])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("prompt_ids", "id {V} ", "[0, {V})")),
    Case("prompt_id_uint32_max", lambda V, P: [open_msg([UINT32_MAX, *P])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("prompt_ids", f"id {UINT32_MAX} ", "[0, {V})")),
    Case("stop_id_oov", lambda V, P: [open_msg(P, stop_ids=[A, V + 3])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("stop_ids", "id {V3} ", "[0, {V})")),
    Case("draft_id_oov", lambda V, P: [open_msg(P), draft_msg(0, [A, V])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("draft.token_ids", "id {V} ", "[0, {V})")),
    Case("draft_id_oov_round1",
         lambda V, P: [open_msg(P), draft_msg(0, [A]), draft_msg(1, [V + 3])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("draft.token_ids", "id {V3} "), round=1),
    Case("q_support_id_oov",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, V], [0.5, 0.5])])], INVALID,
         Reason.REASON_TOKEN_OUT_OF_RANGE, ("q[0].ids", "id {V} ", "[0, {V})")),
    # draft shape
    Case("empty_draft", lambda V, P: [open_msg(P), draft_msg(0, [])], INVALID,
         Reason.REASON_EMPTY_DRAFT, ("no tokens", "k >= 1")),
    Case("draft_too_long", lambda V, P: [open_msg(P), draft_msg(0, [A] * (MAX_DRAFT + 1))],
         INVALID, Reason.REASON_DRAFT_TOO_LONG,
         (f"{MAX_DRAFT + 1} tokens", f"at most {MAX_DRAFT} per round")),
    # rounds and session state
    Case("round_ahead", lambda V, P: [open_msg(P), draft_msg(1, [A])], PRECONDITION,
         Reason.REASON_WRONG_ROUND, ("for round 1", "expects round 0"), round=1),
    Case("round_replayed",
         lambda V, P: [open_msg(P), draft_msg(0, [A, B]), draft_msg(0, [A, B])], PRECONDITION,
         Reason.REASON_WRONG_ROUND, ("for round 0", "expects round 1"), round=0),
    Case("round_skipped",
         lambda V, P: [open_msg(P), draft_msg(0, [A]), draft_msg(2, [A])], PRECONDITION,
         Reason.REASON_WRONG_ROUND, ("for round 2", "expects round 1"), round=2),
    Case("draft_before_open", lambda V, P: [draft_msg(0, [A])], PRECONDITION,
         Reason.REASON_NO_SESSION, ("before open", "send an open message first")),
    Case("draft_after_finish",
         lambda V, P: [open_msg(P, max_new_tokens=1), draft_msg(0, [A]), draft_msg(1, [A])],
         PRECONDITION, Reason.REASON_SESSION_FINISHED,
         ("already finished", "FINISH_REASON_LENGTH", "after 1 tokens"), round=1),
    Case("second_open", lambda V, P: [open_msg(P), open_msg(P)], PRECONDITION,
         Reason.REASON_PROTOCOL, ("already has an open session", "open a new stream")),
    Case("second_open_after_round",
         lambda V, P: [open_msg(P), draft_msg(0, [A]), open_msg(P)], PRECONDITION,
         Reason.REASON_PROTOCOL, ("already has an open session",)),
    Case("empty_message_first", lambda V, P: [pb.DeviceMessage()], INVALID,
         Reason.REASON_PROTOCOL, ("empty DeviceMessage", "open, draft, close")),
    Case("empty_message_mid_session", lambda V, P: [open_msg(P), pb.DeviceMessage()], INVALID,
         Reason.REASON_PROTOCOL, ("empty DeviceMessage",)),
    # open parameters
    Case("context_overflow", lambda V, P: [open_msg(P, max_new_tokens=CONTEXT - len(P) + 1)],
         INVALID, Reason.REASON_CONTEXT_OVERFLOW,
         ("prompt ({n} tokens)", f"max_new_tokens ({{over}})", f"context length {CONTEXT}")),
    Case("prompt_longer_than_context", lambda V, P: [open_msg([A] * (CONTEXT + 1), 1)],
         INVALID, Reason.REASON_CONTEXT_OVERFLOW,
         (f"prompt ({CONTEXT + 1} tokens)", f"context length {CONTEXT}")),
    Case("unknown_mode", lambda V, P: [pb.DeviceMessage(open=pb.Open(prompt_ids=P, max_new_tokens=4,
                                                                      mode=7))],
         INVALID, Reason.REASON_PROTOCOL, ("unknown generation mode 7", "GENERATION_MODE_SERVER")),
    Case("empty_prompt", lambda V, P: [open_msg([])], INVALID, Reason.REASON_PROTOCOL,
         ("prompt_ids is empty", "at least one token")),
    Case("max_new_tokens_zero", lambda V, P: [open_msg(P, max_new_tokens=0)], INVALID,
         Reason.REASON_PROTOCOL, ("max_new_tokens must be >= 1",)),
    Case("tokenizer_mismatch",
         lambda V, P: [open_msg(P, fingerprint=OTHER_FP, drafter="hf:other-drafter")],
         PRECONDITION, Reason.REASON_TOKENIZER_MISMATCH,
         ("{model}", short(OTHER_FP), "hf:other-drafter", "does not match")),
    Case("no_fingerprint", lambda V, P: [open_msg(P, fingerprint="")], INVALID,
         Reason.REASON_TOKENIZER_MISMATCH,
         ("tokenizer_fingerprint is empty", "sends drafts", short(TARGET_FP))),
    Case("temperature_negative", lambda V, P: [open_msg(P, temperature=-0.5)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("bad sampling params", "temperature must be >= 0")),
    Case("temperature_nan", lambda V, P: [open_msg(P, temperature=math.nan)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("temperature must be >= 0",)),
    Case("top_p_above_one", lambda V, P: [open_msg(P, temperature=0.8, top_p=1.5)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("bad sampling params", "top_p must be in [0, 1]", "1.5")),
    Case("top_p_negative", lambda V, P: [open_msg(P, temperature=0.8, top_p=-0.5)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("bad sampling params", "top_p must be in [0, 1]", "-0.5")),
    Case("top_p_nan", lambda V, P: [open_msg(P, temperature=0.8, top_p=math.nan)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("top_p must be in [0, 1]", "nan")),
    Case("temperature_inf", lambda V, P: [open_msg(P, temperature=math.inf)], INVALID,
         Reason.REASON_BAD_SAMPLING, ("temperature must be >= 0 and finite", "inf")),
    # free text
    Case("drafter_too_long", lambda V, P: [open_msg(P, drafter="d" * 129)], INVALID,
         Reason.REASON_PROTOCOL, ("open.drafter", "129 characters", "at most 128")),
    Case("fingerprint_too_long", lambda V, P: [open_msg(P, fingerprint="sha256:" + "f" * 200)],
         INVALID, Reason.REASON_PROTOCOL, ("open.tokenizer_fingerprint", "at most 128")),
    # sparse q of a sampling draft
    Case("q_count_short", lambda V, P: [sampling_open(P), draft_msg(0, [A, B], VALID_Q)],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("2 tokens but 1 q entries",)),
    Case("q_count_long",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], VALID_Q * 2)], INVALID,
         Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("1 tokens but 2 q entries",)),
    Case("q_sum_below_one", lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [0.5, 0.3])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "sum to 0.8000", "not 1")),
    Case("q_sum_above_one_round1",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], VALID_Q),
                       draft_msg(1, [A, B], [([A], [1.0]), ([B, C], [0.9, 0.2])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[1]", "sum to 1.1000"), round=1),
    Case("q_zero_prob", lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [1.0, 0.0])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "probs > 0")),
    Case("q_negative_prob",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [1.5, -0.5])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "probs > 0")),
    Case("q_nan_prob",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [math.nan, 1.0])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "probs > 0")),
    Case("q_inf_prob",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [math.inf, 1.0])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "finite probs > 0")),
    Case("q_duplicate_ids",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, A], [0.5, 0.5])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "distinct ids")),
    Case("draft_token_outside_q",
         lambda V, P: [sampling_open(P), draft_msg(0, [A, C], [([A], [1.0]), ([A, B], [0.5, 0.5])])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION,
         (f"draft token {C} at position 1", "outside its q support")),
    Case("q_support_too_large",
         lambda V, P: [sampling_open(P),
                       draft_msg(0, [A], [(list(range(A, A + MAX_Q + 1)), [1 / (MAX_Q + 1)] * (MAX_Q + 1))])],
         INVALID, Reason.REASON_BAD_DRAFT_DISTRIBUTION,
         (f"q[0] has {MAX_Q + 1} entries", f"at most {MAX_Q} allowed")),
    Case("q_ids_probs_length_mismatch",
         lambda V, P: [sampling_open(P), draft_msg(0, [A], [([A, B], [1.0])])], INVALID,
         Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "equal, non-zero length")),
    Case("q_empty_entry", lambda V, P: [sampling_open(P), draft_msg(0, [A], [([], [])])], INVALID,
         Reason.REASON_BAD_DRAFT_DISTRIBUTION, ("q[0]", "equal, non-zero length")),
]


# --- helpers ----------------------------------------------------------------------------------

async def run_steps(stub, steps: list[pb.DeviceMessage]):
    """Send each message and read its reply; every reply before the last must be a success."""
    call = stub.Generate()
    reply = None
    for i, msg in enumerate(steps):
        await call.write(msg)
        reply = await call.read()
        if i < len(steps) - 1:
            assert reply is not grpc.aio.EOF
            assert reply.WhichOneof("kind") in ("opened", "verdict"), f"step {i}: {reply}"
            if reply.WhichOneof("kind") == "verdict" and i < len(steps) - 2:
                assert reply.verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    return call, reply


async def assert_refused(call, reply, code: grpc.StatusCode, reason: int, phrases=(),
                         round: int | None = None) -> str:
    """The stream's last message is an ErrorDetail with `reason`; then, the device's side
    closed, it ends with `code`."""
    assert reply is not grpc.aio.EOF, "stream ended without an ErrorDetail"
    assert reply.WhichOneof("kind") == "error", f"expected an error, got {reply}"
    await half_close(call)
    assert Reason.Name(reply.error.reason) == Reason.Name(reason)
    assert await call.code() == code
    details = await call.details()
    assert details == reply.error.message
    for phrase in phrases:
        assert phrase in details, f"{phrase!r} not in {details!r}"
    if round is not None:
        assert reply.error.round == round
    with pytest.raises(grpc.aio.AioRpcError) as exc:   # nothing follows the error
        await call.read()
    assert exc.value.code() == code
    return details


def format_phrases(case: Case, V: int, P: list[int]) -> tuple[str, ...]:
    over = CONTEXT - len(P) + 1
    return tuple(p.format(V=V, V3=V + 3, n=len(P), over=over, model=MODEL_ID) for p in case.phrases)


async def check_case(stub, case: Case, V: int, P: list[int]) -> None:
    call, reply = await run_steps(stub, case.steps(V, P))
    await assert_refused(call, reply, case.code, case.reason, format_phrases(case, V, P), case.round)


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def clean(server) -> bool:
    return (not server.service.core.sessions and server.metrics.value("sled_kv_tokens") == 0
            and server.metrics.value("sled_active_sessions") == 0)


async def wait_clean(server) -> None:
    await wait_until(lambda: clean(server), "no sessions, no KV, no active sessions")


async def oversized_open(stub, V: int) -> grpc.aio.AioRpcError:
    """An Open larger than max_message_bytes: grpc itself refuses it before the service sees it."""
    call = stub.Generate()
    await call.write(open_msg([V - 1] * MAX_MESSAGE, max_new_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call.read()
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return exc.value


@pytest.fixture
async def raw(serve, models):
    """raw(**config) -> (server, stub) on a fresh server; the channels close after the test."""
    channels = []

    async def start(**config):
        server = await serve(models["llama"], model_id=MODEL_ID, **config)
        channel = grpc.aio.insecure_channel(server.address)
        channels.append(channel)
        return server, VerifierStub(channel)

    yield start
    for channel in channels:
        await channel.close()


# --- every refusal, one stream each ------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_refusal(case: Case, raw, prompts, tokenizer):
    server, stub = await raw(**LIMITS)
    V = server.service.core.target.vocab_size
    assert V == len(tokenizer)
    P = prompts[0]
    assert 1 < len(P) < CONTEXT // 4
    before = errors_counted(server, case.reason)
    await check_case(stub, case, V, P)
    assert errors_counted(server, case.reason) == before + 1
    await wait_clean(server)   # a refused session leaves nothing behind
    # ... and the server still works for the next stream
    call, reply = await run_steps(stub, [open_msg(P), draft_msg(0, [A])])
    assert reply.WhichOneof("kind") == "verdict" and reply.verdict.round == 0
    call.cancel()


async def test_limits_are_inclusive(raw, prompts):
    """Exactly at each limit is accepted, so the refusals above are about the limit, not near it."""
    server, stub = await raw(**LIMITS)
    P = prompts[0]
    fits = CONTEXT - len(P)
    call, reply = await run_steps(stub, [
        sampling_open(P, max_new_tokens=fits, fingerprint=server.service.core.target.fingerprint),
        draft_msg(0, [A] * MAX_DRAFT, [(list(range(A, A + MAX_Q)), [1 / MAX_Q] * MAX_Q)] * MAX_DRAFT),
    ])
    assert reply.WhichOneof("kind") == "verdict", reply
    assert reply.verdict.verified == MAX_DRAFT
    await call.write(pb.DeviceMessage(close=pb.Close()))
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    # a greedy session ignores q entirely (a deterministic drafter sends none)
    call, reply = await run_steps(stub, [open_msg(P), draft_msg(0, [A] * MAX_DRAFT)])
    assert reply.WhichOneof("kind") == "verdict" and reply.verdict.verified == MAX_DRAFT
    call.cancel()
    await wait_clean(server)
    assert server.metrics.value("sled_errors_total", {"reason": "context_overflow"}) == 0


# --- server-wide conditions ------------------------------------------------------------------

async def test_too_many_sessions(raw, prompts):
    server, stub = await raw(max_sessions=2)
    P = prompts[0]
    first, reply = await run_steps(stub, [open_msg(P)])
    assert reply.WhichOneof("kind") == "opened"
    second, reply = await run_steps(stub, [open_msg(P)])
    assert reply.WhichOneof("kind") == "opened"
    # refused opens do not take a place
    await check_case(stub, CASES[0], server.service.core.target.vocab_size, P)

    third, reply = await run_steps(stub, [open_msg(P)])
    await assert_refused(third, reply, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         Reason.REASON_TOO_MANY_SESSIONS, ("limit of 2 sessions", "retry later"))
    assert errors_counted(server, Reason.REASON_TOO_MANY_SESSIONS) == 1
    assert len(server.service.core.sessions) == 2

    # the open sessions are unaffected
    await first.write(draft_msg(0, [A]))
    assert (await first.read()).verdict.round == 0

    # closing one frees its place
    await second.write(pb.DeviceMessage(close=pb.Close()))
    assert await second.read() is grpc.aio.EOF
    assert await second.code() == grpc.StatusCode.OK
    await wait_until(lambda: len(server.service.core.sessions) == 1, "the closed session to go")
    fourth, reply = await run_steps(stub, [open_msg(P)])
    assert reply.WhichOneof("kind") == "opened"

    # a session ended by an error frees its place too
    await fourth.write(draft_msg(5, [A]))
    await assert_refused(fourth, await fourth.read(), PRECONDITION, Reason.REASON_WRONG_ROUND)
    await wait_until(lambda: len(server.service.core.sessions) == 1, "the refused session to go")
    fifth, reply = await run_steps(stub, [open_msg(P), draft_msg(0, [A])])
    assert reply.WhichOneof("kind") == "verdict"

    first.cancel()
    fifth.cancel()
    await wait_clean(server)


async def test_oversized_messages(raw, prompts, models):
    server, stub = await raw(max_message_bytes=MAX_MESSAGE)
    V = server.service.core.target.vocab_size
    P = prompts[0]
    healthy, reply = await run_steps(stub, [open_msg(P, max_new_tokens=6)])
    assert reply.WhichOneof("kind") == "opened"

    error = await oversized_open(stub, V)
    assert f"vs. {MAX_MESSAGE}" in (error.details() or ""), error.details()

    # an oversized draft mid-session ends that session and frees it
    victim, reply = await run_steps(stub, [open_msg(P)])
    assert reply.WhichOneof("kind") == "opened"
    await victim.write(draft_msg(0, [A] * MAX_MESSAGE))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await victim.read()
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await wait_until(lambda: len(server.service.core.sessions) == 1, "the oversized session to go")

    # the session opened before carries on, and its tokens are the target's
    expected = greedy_reference(models["llama"], P, 2)
    await healthy.write(draft_msg(0, expected[:1]))
    verdict = (await healthy.read()).verdict
    assert list(verdict.emitted_ids) == expected
    healthy.cancel()
    await wait_clean(server)


async def test_shutting_down_refuses_open(raw, prompts, models):
    server, stub = await raw()
    P = prompts[0]
    running, reply = await run_steps(stub, [open_msg(P)])
    assert reply.WhichOneof("kind") == "opened"
    server.service.core.accepting = False
    call, reply = await run_steps(stub, [open_msg(P)])
    await assert_refused(call, reply, grpc.StatusCode.UNAVAILABLE, Reason.REASON_SHUTTING_DOWN,
                         ("shutting down", "retry on another server"))
    assert errors_counted(server, Reason.REASON_SHUTTING_DOWN) == 1
    # sessions already open may finish
    expected = greedy_reference(models["llama"], P, 3)
    await running.write(draft_msg(0, expected[:2]))
    verdict = (await running.read()).verdict
    assert verdict.accepted == 2 and list(verdict.emitted_ids) == expected
    running.cancel()
    await wait_clean(server)


# --- tokenizer mismatch, through the client --------------------------------------------------

class RecordingStub:
    """A stub that counts Generate calls and passes them on."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.calls = 0

    def Generate(self, *args, **kwargs):
        self.calls += 1
        return self.stub.Generate(*args, **kwargs)


@pytest.fixture(scope="module")
def other_tokenizer():
    return make_tokenizer(vocab_size=300)


async def test_client_refuses_mismatched_drafter_before_sending(raw, prompts, models, tokenizer,
                                                               other_tokenizer):
    server, stub = await raw()
    target_fp = server.service.core.target.fingerprint
    drafter = HFDrafter(models["llama"], other_tokenizer, name="hf:other")
    assert drafter.tokenizer_fingerprint != target_fp
    spy = RecordingStub(stub)
    with pytest.raises(VerifyError) as exc:
        await generate(spy, drafter, SessionRequest(prompts[0], max_new_tokens=4),
                       target=Target(fingerprint=target_fp))
    assert exc.value.code == PRECONDITION
    assert exc.value.reason == "REASON_TOKENIZER_MISMATCH"
    assert "hf:other" in exc.value.message
    assert short(drafter.tokenizer_fingerprint) in exc.value.message
    assert short(target_fp) in exc.value.message
    assert spy.calls == 0
    assert server.metrics.value("sled_sessions_total") == 0

    # without the target's fingerprint the client sends its own, and the server refuses it
    with pytest.raises(VerifyError) as exc:
        await generate(spy, drafter, SessionRequest(prompts[0], max_new_tokens=4))
    assert exc.value.code == PRECONDITION
    assert exc.value.reason == "REASON_TOKENIZER_MISMATCH"
    assert MODEL_ID in exc.value.message and "hf:other" in exc.value.message
    assert spy.calls == 1
    assert errors_counted(server, Reason.REASON_TOKENIZER_MISMATCH) == 1

    # control: the same drafter model with the target's tokenizer goes through
    same = HFDrafter(models["llama"], tokenizer, name="hf:same")
    result = await generate(spy, same, SessionRequest(prompts[0], max_new_tokens=5),
                            target=Target(fingerprint=target_fp))
    assert result.token_ids == greedy_reference(models["llama"], prompts[0], 5)
    await wait_clean(server)


# --- isolation -------------------------------------------------------------------------------

async def test_bad_streams_do_not_disturb_good_sessions(raw, prompts, models):
    """Every refusal above, all at once, interleaved with healthy sessions on the same server."""
    server, stub = await raw(**LIMITS)
    model = models["llama"]
    V = server.service.core.target.vocab_size
    n = 12
    good_prompts = prompts[:6]
    expected = [greedy_reference(model, p, n) for p in good_prompts]

    async def good(prompt):
        return await generate(stub, NgramDrafter(), SessionRequest(prompt, max_new_tokens=n),
                              settings=RoundSettings(draft_len=MAX_DRAFT))

    bad = [check_case(stub, case, V, prompts[i % len(prompts)]) for i, case in enumerate(CASES)]
    bad += [oversized_open(stub, V) for _ in range(2)]
    jobs: list = []
    stride = max(1, len(bad) // len(good_prompts))
    goods = iter(good_prompts)
    for i, job in enumerate(bad):
        if i % stride == 0:
            prompt = next(goods, None)
            if prompt is not None:
                jobs.append(good(prompt))
        jobs.append(job)
    jobs.extend(good(p) for p in goods)
    assert len(jobs) == len(bad) + len(good_prompts)

    results = await asyncio.gather(*jobs)
    good_results = [r for r in results if r is not None and hasattr(r, "token_ids")]
    assert [r.token_ids for r in good_results] == expected
    assert all(r.finish_reason in ("length", "eos") for r in good_results)

    # each refusal was counted under its reason
    for reason in {case.reason for case in CASES}:
        assert errors_counted(server, reason) == sum(c.reason == reason for c in CASES), \
            reason_label(reason)
    # the healthy sessions really shared forward passes with each other
    assert server.metrics.value("sled_batch_size_sum") > server.metrics.value("sled_batch_size_count")
    await wait_clean(server)


# --- disconnects -----------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["after_open", "after_verdict", "channel_closed"])
async def test_disconnect_frees_session(when, raw, prompts):
    server, stub = await raw()
    channel = None
    if when == "channel_closed":
        channel = grpc.aio.insecure_channel(server.address)
        stub = VerifierStub(channel)
    P = prompts[2]
    steps = [open_msg(P)] if when == "after_open" else [open_msg(P), draft_msg(0, [A, B])]
    call, reply = await run_steps(stub, steps)
    assert reply.WhichOneof("kind") in ("opened", "verdict")
    assert len(server.service.core.sessions) == 1
    assert server.metrics.value("sled_active_sessions") == 1
    assert server.metrics.value("sled_kv_tokens") > 0
    if channel is not None:
        await channel.close()
    else:
        call.cancel()
    await wait_clean(server)
    assert server.metrics.value("sled_errors_total", {"reason": "protocol"}) == 0


class Gate:
    """Holds the engine's next forward pass until opened (the pass is then 'in flight')."""

    def __init__(self, server) -> None:
        self.engine = server.scheduler.engine
        self.original = self.engine.forward
        self.entered = threading.Event()
        self.release = threading.Event()
        self.engine.forward = self._forward

    def _forward(self, rows):
        self.engine.forward = self.original   # one pass only
        self.entered.set()
        assert self.release.wait(10)
        return self.original(rows)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "the forward never started"


@pytest.mark.parametrize("stage", ["prefill", "verify"])
async def test_cancel_while_in_flight(stage, raw, prompts, models):
    server, stub = await raw()
    P = prompts[1]
    assert len(P) > 2
    victim = stub.Generate()
    if stage == "verify":
        await victim.write(open_msg(P))
        assert (await victim.read()).WhichOneof("kind") == "opened"
    gate = Gate(server)
    await victim.write(open_msg(P) if stage == "prefill" else draft_msg(0, [A, B, C]))
    await gate.wait_entered()            # the victim's prefill / verify is in the forward now
    victim.cancel()
    await wait_until(lambda: not server.service.core.sessions, "the cancelled session to go")
    gate.release.set()
    await wait_clean(server)
    # the engine and the scheduler are fine afterwards
    result = await generate(stub, NgramDrafter(), SessionRequest(P, max_new_tokens=6))
    assert result.token_ids == greedy_reference(models["llama"], P, 6)
    await wait_clean(server)


async def test_cancel_while_verify_queued(raw, prompts, models):
    server, stub = await raw()
    model = models["llama"]
    P, Q = prompts[1], prompts[3]
    expected = greedy_reference(model, P, 4)
    busy, reply = await run_steps(stub, [open_msg(P, ignore_eos=False)])
    assert reply.WhichOneof("kind") == "opened"
    victim, reply = await run_steps(stub, [open_msg(Q)])
    assert reply.WhichOneof("kind") == "opened"
    gate = Gate(server)
    await busy.write(draft_msg(0, expected[:3]))
    await gate.wait_entered()            # busy's verify is in flight ...
    await victim.write(draft_msg(0, [A, B]))
    await wait_until(lambda: len(server.scheduler._queue) == 1, "the victim's verify to queue")
    victim.cancel()                      # ... and the victim's waits behind it
    await wait_until(lambda: len(server.service.core.sessions) == 1 and not server.scheduler._queue,
                     "the queued session to go")
    gate.release.set()
    verdict = (await busy.read()).verdict
    assert verdict.accepted == 3 and list(verdict.emitted_ids) == expected
    busy.cancel()
    await wait_clean(server)


async def test_cancel_right_after_draft_under_load(raw, prompts, models):
    """Many sessions at once; some devices vanish right after sending a draft."""
    server, stub = await raw()
    model = models["llama"]
    n = 10
    expected = [greedy_reference(model, p, n) for p in prompts]

    async def good(prompt):
        result = await generate(stub, NgramDrafter(), SessionRequest(prompt, max_new_tokens=n))
        return result.token_ids

    async def vanish(prompt, rounds: int):
        call = stub.Generate()
        await call.write(open_msg(prompt, max_new_tokens=n))
        assert (await call.read()).WhichOneof("kind") == "opened"
        for r in range(rounds):
            await call.write(draft_msg(r, [A, B]))
            assert (await call.read()).verdict.round == r
        await call.write(draft_msg(rounds, [A, B, C]))
        call.cancel()

    jobs = [good(p) for p in prompts] + [vanish(p, i % 3) for i, p in enumerate(prompts * 2)]
    results = await asyncio.gather(*jobs)
    assert results[: len(prompts)] == expected
    await wait_clean(server)
    assert server.metrics.value("sled_sessions_total") == 3 * len(prompts)
