"""The device session loop: open, draft, send, take the verdict, commit, roll back, repeat."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc
import torch

from drafters.base import Drafter, Proposal, SparseQ, confidence_options
from edge_client.draft_policy import DraftPolicy
from edge_client.profiles import Link
from edge_client.speculation import Speculation, first, joined
from sled.fingerprint import short
from sled.sampling import Sampling
from sled.v1 import verifier_pb2 as pb

FINISH_NAMES = {pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop",
                pb.FINISH_REASON_LENGTH: "length"}
# The drafter's random stream must differ from the server's for the same request seed.
DRAFTER_SEED_OFFSET = 0x5EED


class VerifyError(Exception):
    """The server ended the session with an error status."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RoundStat:
    draft_ms: float          # the device's turn: from the previous verdict to this draft sent
    round_trip_ms: float     # draft sent -> verdict received
    forward_ms: float        # the server's batched forward + acceptance
    queue_ms: float          # waiting on the server for a place in a forward
    verified: int
    accepted: int
    suggested_draft_len: int = 0   # the server's advice for the next draft (0 = none)
    pipelined: int = 0             # draft tokens drafted while the previous verdict was in flight


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    rounds: int = 0
    draft_tokens: int = 0          # draft tokens the server verified
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    server_forward_ms: float = 0.0
    resumes: int = 0               # sessions reopened after an eviction or a lost server
    hint_tokens: int = 0           # draft tokens that came from the server's SAT hints
    pipelined_tokens: int = 0      # draft tokens drafted ahead while a verdict was in flight
    text: str = ""
    round_stats: list[RoundStat] = field(default_factory=list)
    # perf_counter seconds since the session started at which each token arrived (one stamp per
    # token; the tokens of one verdict share it)
    token_times: list[float] = field(default_factory=list)

    def add(self, verdict: pb.Verdict, started: float) -> bool:
        """Count one verdict's tokens and stats (arrival stamped against `started`, a
        perf_counter time); True when the verdict ends the session."""
        self.rounds += 1
        self.server_forward_ms += verdict.timings.forward_ms
        self.draft_tokens += verdict.verified        # device drafts, or the server's SAT guesses
        self.accepted_tokens += verdict.accepted
        self.token_ids.extend(verdict.emitted_ids)
        self.token_times.extend([time.perf_counter() - started] * len(verdict.emitted_ids))
        if verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return False
        self.finish_reason = FINISH_NAMES[verdict.finish_reason]
        return True

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return len(self.token_ids) / self.rounds if self.rounds else 0.0

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("round_stats")
        out.pop("token_times")
        out.update(acceptance_rate=round(self.acceptance_rate, 4),
                   tokens_per_round=round(self.tokens_per_round, 4),
                   tokens_per_s=round(len(self.token_ids) / self.elapsed_s, 2) if self.elapsed_s else 0.0)
        return out


def open_message(prompt_ids: Sequence[int], sampling: Sampling, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), fingerprint: str = "", drafter: str = "",
                 ignore_eos: bool = False,
                 mode: int = pb.GENERATION_MODE_DEVICE_DRAFTS) -> pb.DeviceMessage:
    msg = pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                        stop_ids=list(stop_ids), tokenizer_fingerprint=fingerprint,
                                        drafter=drafter, ignore_eos=ignore_eos, mode=mode))
    sampling.to_proto(msg.open.sampling)
    return msg


# First draft length of a draft_len="auto" session, before the server has suggested one.
AUTO_FIRST_DRAFT_LEN = 4


def draft_message(round: int, proposal: Proposal, lookahead: int = 0) -> pb.DeviceMessage:
    q = [pb.SparseDistribution(ids=d.ids, probs=d.probs) for d in proposal.q or ()]
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=proposal.token_ids, q=q,
                                           lookahead=lookahead))


def with_hints(hints: list[int], proposal: Proposal | None) -> Proposal:
    """A draft that starts with the server's SAT hints (deterministic: q one-hot) and goes on
    with the drafter's own proposal from after them."""
    if proposal is None:
        return Proposal(list(hints), None)
    q = None
    if proposal.q is not None:
        q = [SparseQ([h], [1.0]) for h in hints] + list(proposal.q)
    return Proposal(list(hints) + list(proposal.token_ids), q)


async def read_reply(call) -> pb.ServerMessage:
    """Next server message; an error message or a broken stream becomes a VerifyError."""
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise VerifyError(exc.code(), exc.details() or "") from None
    if msg is grpc.aio.EOF:
        code = await call.code()
        raise VerifyError(code, await call.details() or "stream ended before the session finished")
    if msg.WhichOneof("kind") == "error":
        code = await call.code()
        reason = pb.ErrorDetail.Reason.Name(msg.error.reason)
        raise VerifyError(code, msg.error.message, reason)
    return msg


async def _send(call, msg: pb.DeviceMessage, link: Link | None) -> None:
    """Write one message after the link's uplink delay; a stream the server already ended
    becomes a VerifyError with the status it ended with (as a failed read does)."""
    if link is not None:
        await link.uplink(msg.ByteSize())
    try:
        await call.write(msg)
    except asyncio.InvalidStateError:
        raise VerifyError(await call.code(), await call.details() or "stream already ended") from None
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.INTERNAL:
            raise
        # The transport broke under the write (grpc core's failed send batch): the server is
        # gone or going, and it never saw this message.
        raise VerifyError(grpc.StatusCode.UNAVAILABLE, f"the stream broke while sending: {exc.details()}") from None


async def _receive(call, link: Link | None) -> pb.ServerMessage:
    """Read one message, then wait out the link's downlink delay."""
    msg = await read_reply(call)
    if link is not None:
        await link.downlink(msg.ByteSize())
    return msg


def _lost_server(error: Exception) -> bool:
    """The server is gone or going (as opposed to refusing this session)."""
    code = error.code if isinstance(error, VerifyError) else error.code()
    return code == grpc.StatusCode.UNAVAILABLE


async def generate(
    stub,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    draft_len: int | str = 4,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    target_fingerprint: str | None = None,
    ignore_eos: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout: float | None = None,
    link: Link | None = None,
    lookahead: int = 0,
    reconnect_s: float = 30.0,
    reopen_on: Callable[[], object] | None = None,
    on_round: Callable[[RoundStat], None] | None = None,
    max_draft_len: int = 16,
    min_confidence: float = 0.0,
    pipeline: bool = False,
    policy: DraftPolicy | None = None,
) -> GenerationResult:
    """Run one generation session to its end; on_tokens sees each verdict's committed tokens.

    lookahead=m asks the server for m SAT hints per verdict (a SAT-tuned target): when the last
    draft was accepted whole, the next draft starts with the hints and the drafter continues
    after them. Output is the target's either way; hints only change how many tokens a round
    yields (`GenerationResult.hint_tokens` counts the ones sent).

    If the server goes away mid-session (UNAVAILABLE: a restart, a dropped link) the session is
    reopened with the prompt + its committed tokens, retrying with backoff for up to
    `reconnect_s` seconds (0: fail at once); `GenerationResult.resumes` counts the reopenings.
    `reopen_on()`, when given, is asked for the stub to use after each lost server (a failover:
    the device's choice of server may have moved); each attempt waits at most a few seconds for
    its server. With it, the first open (on `stub`) waits and retries the same way. on_round sees each round's RoundStat.

    draft_len="auto" drafts what the previous verdict suggested (AUTO_FIRST_DRAFT_LEN at first);
    draft_len="adaptive" lets a DraftPolicy pick the k with the most expected tokens per second
    from this session's acceptance, drafting speed and round trips (at most max_draft_len),
    capped by the suggestion. `policy` passes in the DraftPolicy to use and keep teaching (a
    device's earlier sessions on the same server: its timings and acceptance carry over);
    default: a fresh one.
    `link` emulates the network: every message waits for it. A drafter with an async apropose()
    (an emulated device) is awaited directly instead of running propose() in a thread.

    min_confidence > 0 ends a draft early after the first token the drafter is less sure of
    (its probability of the token it drafted); drafters without a confidence (n-gram, traces
    recorded without one) draft k. pipeline=True keeps drafting while each verdict is in flight,
    on the path where the whole draft is accepted and the bonus is the drafter's own next token
    (edge_client/speculation.py); when the verdict goes that way the next draft starts with those
    tokens (`GenerationResult.pipelined_tokens` counts them). It drafts ahead only in rounds where
    the session's own estimates say it gains more than the step it may have to wait out costs
    (DraftPolicy.pipelining_pays). Output is the target's either way.
    Seeded sampling sessions never pipeline: how many tokens get drafted ahead depends on timing,
    and every draw moves the drafter's random stream, so a seeded run would not repeat itself.
    """
    fingerprint = drafter.tokenizer_fingerprint or target_fingerprint or ""
    if target_fingerprint and drafter.tokenizer_fingerprint and \
            drafter.tokenizer_fingerprint != target_fingerprint:
        raise VerifyError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"drafter {drafter.name} has tokenizer {short(drafter.tokenizer_fingerprint)}, "
                          f"the server's target has {short(target_fingerprint)}: they cannot share drafts",
                          "REASON_TOKENIZER_MISMATCH")
    generator = None
    if not sampling.greedy:
        generator = torch.Generator()
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed + DRAFTER_SEED_OFFSET)
        else:
            generator.seed()

    apropose = getattr(drafter, "apropose", None)
    options = confidence_options(drafter, min_confidence)
    pipelining = pipeline and (sampling.greedy or sampling.seed is None)
    adaptive = draft_len == "adaptive"
    # The policy's estimates (acceptance, drafting and round-trip times) choose k when adaptive
    # and tell whether drafting ahead pays when pipelining.
    if policy is None and (adaptive or pipelining):
        policy = DraftPolicy(max_k=max_draft_len)
    k = policy.choose() if adaptive else AUTO_FIRST_DRAFT_LEN if draft_len == "auto" else draft_len
    started = time.perf_counter()
    context = list(prompt_ids)
    result = GenerationResult(token_ids=[], finish_reason="")

    async def open_once(connect_s: float | None = None, switch: bool = False):
        """Open a session for what is left. connect_s (resuming) waits up to that long for the
        server to take the open message, then as long as the prefill takes. switch: the last
        attempt lost its server, so ask reopen_on() which one to use now."""
        nonlocal stub
        resuming = connect_s is not None
        if switch and reopen_on is not None:
            stub = reopen_on()
        call = stub.Generate(timeout=timeout, wait_for_ready=resuming)
        try:
            opening = _send(call, open_message(context, sampling, max_new_tokens - len(result.token_ids),
                                               stop_ids, fingerprint, drafter.name, ignore_eos), link)
            await (asyncio.wait_for(opening, connect_s) if resuming else opening)
            await _receive(call, link)  # opened: the prompt is in the server's KV
        except BaseException:
            call.cancel()
            raise
        return call

    async def open_stream(resuming: bool = False, lost: bool = False):
        """A session for what is left: the prompt plus everything committed so far. When
        resuming (or opening with a server chooser), retry with backoff until `reconnect_s` has
        passed; each attempt waits for its server a bounded time, and every attempt after a
        lost server asks again which server to use (the one it waited for may be gone for good)."""
        if not resuming:
            return await open_once()
        give_up, pause, connect_s = time.monotonic() + reconnect_s, 0.05, 1.0
        while True:
            left = give_up - time.monotonic()
            try:
                return await open_once(max(min(left, connect_s), 0.01), switch=lost)
            except asyncio.TimeoutError:
                if left <= connect_s:
                    raise VerifyError(grpc.StatusCode.UNAVAILABLE,
                                      f"no server came back within {reconnect_s:g} s to resume the "
                                      f"session after {len(result.token_ids)} committed tokens") from None
                connect_s = min(connect_s * 2, 8.0)
            except (VerifyError, grpc.aio.AioRpcError) as error:
                if not _lost_server(error) or time.monotonic() + pause > give_up:
                    raise
            lost = True
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)

    async def draft(ahead: list[int], n: int, how: Sampling = sampling) -> Proposal:
        """n tokens (fewer after an early stop) continuing `ahead`, from the drafter."""
        if apropose is not None:
            return await apropose(ahead, n, how, generator, **options)
        return await asyncio.to_thread(drafter.propose, ahead, n, how, generator, **options)

    async def next_draft(hints: list[int], ahead: Proposal | None, ahead_ends: bool):
        """This round's draft of k: the server's SAT hints, else the tokens drafted ahead while
        the last verdict was in flight (all of them when an early stop ended them), then the
        drafter's own for the rest. Returns (draft, hint tokens in it, pipelined tokens in it)."""
        if hints:
            hints = hints[:k]
            rest = k - len(hints)
            return with_hints(hints, await draft(context + hints, rest) if rest else None), len(hints), 0
        if ahead is None:
            return await draft(context, k), 0, 0
        head = first(ahead, k)
        rest = 0 if ahead_ends else k - len(head.token_ids)
        tail = await draft(context + head.token_ids, rest) if rest else None
        return joined(head, tail), 0, len(head.token_ids)

    def speculate(proposal: Proposal) -> Speculation | None:
        """Draft ahead while this draft's verdict is in flight, up to a next draft of k and no
        further than the session's token budget."""
        cap = min(k, max_new_tokens - len(result.token_ids) - len(proposal.token_ids) - 1)
        if not pipelining or cap < 1 or not policy.pipelining_pays(len(proposal.token_ids)):
            return None
        return Speculation(lambda path, how: draft(path, 1, how), context + proposal.token_ids,
                           len(proposal.token_ids), cap, sampling, min_confidence)

    call = speculation = None
    try:
        call, round, hints = await open_stream(resuming=reopen_on is not None), 0, []
        ahead, ahead_ends, turn_started = None, False, None
        while True:
            drafting = turn_started or time.perf_counter()
            proposal, hinted, pipelined = await next_draft(hints, ahead, ahead_ends)
            result.hint_tokens += hinted
            result.pipelined_tokens += pipelined
            speculation = speculate(proposal)
            sent = time.perf_counter()
            try:
                await _send(call, draft_message(round, proposal, lookahead), link)
                verdict = (await _receive(call, link)).verdict
            except (VerifyError, grpc.aio.AioRpcError) as error:
                evicted = isinstance(error, VerifyError) and error.reason == "REASON_EVICTED"
                if not evicted and not (reconnect_s and _lost_server(error)):
                    raise
                # The server freed this session (idle eviction) or went away (restart, network):
                # resume where the committed tokens end. A verdict that never arrived committed
                # nothing here, so no token is lost or repeated.
                call.cancel()
                if speculation is not None:
                    await speculation.finish()
                drafter.rollback(len(context))
                result.resumes += 1
                call, round, hints = await open_stream(resuming=not evicted, lost=not evicted), 0, []
                ahead, ahead_ends, turn_started = None, False, None
                continue
            turn_started = time.perf_counter()       # the device's next turn starts at the verdict
            ahead, ahead_ends = None, False
            if speculation is not None:
                await speculation.finish()
                ahead = speculation.kept(verdict.accepted, verdict.emitted_ids)
                ahead_ends = ahead is not None and speculation.ended
            round += 1
            hints = list(verdict.hint_ids)
            if hints:
                ahead = None                         # the server's hints start the next draft
            result.round_stats.append(RoundStat(
                (sent - drafting) * 1e3, (turn_started - sent) * 1e3, verdict.timings.forward_ms,
                verdict.timings.queue_ms, verdict.verified, verdict.accepted,
                verdict.suggested_draft_len, pipelined))
            if on_round is not None:
                on_round(result.round_stats[-1])
            if draft_len == "auto" and verdict.suggested_draft_len:
                k = verdict.suggested_draft_len
            if policy is not None:
                stat = result.round_stats[-1]
                policy.observe(verdict.verified, verdict.accepted, stat.draft_ms, stat.round_trip_ms)
            if adaptive:
                k = policy.choose(verdict.suggested_draft_len)
            if ahead is None:
                # Kept tokens continue the drafter's state as it is; otherwise forget the rest.
                drafter.rollback(len(context) + verdict.accepted)
            context.extend(verdict.emitted_ids)
            finished = result.add(verdict, started)
            if on_tokens is not None:
                on_tokens(list(verdict.emitted_ids))
            if finished:
                break
        await call.done_writing()
    except BaseException:
        if call is not None:
            call.cancel()
        if speculation is not None:
            await speculation.finish()   # leave the drafter idle for whoever uses it next
        raise
    result.elapsed_s = time.perf_counter() - started
    return result


async def generate_server_side(
    stub,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    link: Link | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout: float | None = None,
    mode: int = pb.GENERATION_MODE_SERVER,
) -> GenerationResult:
    """Let the server produce every token (GENERATION_MODE_SERVER, centralized serving, or
    GENERATION_MODE_SERVER_SAT, the target drafting for itself with SATs): open,
    then read one verdict per server step until one carries a finish reason. No drafter.

    Verdicts are read as soon as they come and stamped, so an emulated link delays the stream
    without slowing its rate (see Link.downlink).
    """
    started = time.perf_counter()
    call = stub.Generate(timeout=timeout)
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        """Read every server message the moment it arrives; an error ends the inbox too."""
        try:
            while True:
                msg = await read_reply(call)
                inbox.put_nowait((time.perf_counter(), msg))
                if msg.verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return
        except BaseException as exc:
            inbox.put_nowait((time.perf_counter(), exc))

    async def receive() -> pb.ServerMessage:
        received_at, msg = await inbox.get()
        if isinstance(msg, BaseException):
            raise msg
        if link is not None:
            await link.downlink(msg.ByteSize(), received_at)
        return msg

    reader = None
    try:
        await _send(call, open_message(prompt_ids, sampling, max_new_tokens, stop_ids,
                                       drafter="server", ignore_eos=ignore_eos,
                                       mode=mode), link)
        reader = asyncio.create_task(pump())
        await receive()  # opened
        result = GenerationResult(token_ids=[], finish_reason="")
        while True:
            verdict = (await receive()).verdict
            finished = result.add(verdict, started)
            if on_tokens is not None:
                on_tokens(list(verdict.emitted_ids))
            if finished:
                break
        await call.done_writing()
    except BaseException:
        call.cancel()
        raise
    finally:
        if reader is not None:
            reader.cancel()
    result.elapsed_s = time.perf_counter() - started
    return result
