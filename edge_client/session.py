"""The device session loop: open, draft, send, take the verdict, commit, roll back, repeat."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import grpc
import torch

from drafters.base import Drafter, Proposal
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
    draft_ms: float          # drafting on this device
    round_trip_ms: float     # draft sent -> verdict received
    forward_ms: float        # the server's batched forward + acceptance
    queue_ms: float          # waiting on the server for a place in a forward
    verified: int
    accepted: int


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    rounds: int = 0
    draft_tokens: int = 0          # draft tokens the server verified
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    server_forward_ms: float = 0.0
    text: str = ""
    round_stats: list[RoundStat] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return len(self.token_ids) / self.rounds if self.rounds else 0.0

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("round_stats")
        out.update(acceptance_rate=round(self.acceptance_rate, 4),
                   tokens_per_round=round(self.tokens_per_round, 4),
                   tokens_per_s=round(len(self.token_ids) / self.elapsed_s, 2) if self.elapsed_s else 0.0)
        return out


def open_message(prompt_ids: Sequence[int], sampling: Sampling, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), fingerprint: str = "", drafter: str = "",
                 ignore_eos: bool = False) -> pb.DeviceMessage:
    msg = pb.DeviceMessage(open=pb.Open(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                        stop_ids=list(stop_ids), tokenizer_fingerprint=fingerprint,
                                        drafter=drafter, ignore_eos=ignore_eos))
    sampling.to_proto(msg.open.sampling)
    return msg


def draft_message(round: int, proposal: Proposal) -> pb.DeviceMessage:
    q = [pb.SparseDistribution(ids=d.ids, probs=d.probs) for d in proposal.q or ()]
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=proposal.token_ids, q=q))


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


async def generate(
    stub,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    draft_len: int = 4,
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] = (),
    target_fingerprint: str | None = None,
    ignore_eos: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout: float | None = None,
) -> GenerationResult:
    """Run one generation session to its end; on_tokens sees each verdict's committed tokens."""
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

    started = time.perf_counter()
    call = stub.Generate(timeout=timeout)
    try:
        await call.write(open_message(prompt_ids, sampling, max_new_tokens, stop_ids, fingerprint,
                                      drafter.name, ignore_eos))
        await read_reply(call)  # opened: the prompt is in the server's KV
        context = list(prompt_ids)
        result = GenerationResult(token_ids=[], finish_reason="")
        while True:
            drafting = time.perf_counter()
            proposal = await asyncio.to_thread(drafter.propose, context, draft_len, sampling, generator)
            sent = time.perf_counter()
            await call.write(draft_message(result.rounds, proposal))
            verdict = (await read_reply(call)).verdict
            result.round_stats.append(RoundStat(
                (sent - drafting) * 1e3, (time.perf_counter() - sent) * 1e3, verdict.timings.forward_ms,
                verdict.timings.queue_ms, verdict.verified, verdict.accepted))
            result.server_forward_ms += verdict.timings.forward_ms
            result.rounds += 1
            result.draft_tokens += verdict.verified
            result.accepted_tokens += verdict.accepted
            drafter.rollback(len(context) + verdict.accepted)
            context.extend(verdict.emitted_ids)
            result.token_ids.extend(verdict.emitted_ids)
            if on_tokens is not None:
                on_tokens(list(verdict.emitted_ids))
            if verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = FINISH_NAMES[verdict.finish_reason]
                break
        await call.done_writing()
    except BaseException:
        call.cancel()
        raise
    result.elapsed_s = time.perf_counter() - started
    return result
