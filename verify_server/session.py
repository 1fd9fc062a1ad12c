"""A generation session on the server: what the device asked for and what has been committed.

The session owns its committed state: the tokens generated so far and, through `commit`, how
much of its KV is context. Nothing else moves either after the prompt is in."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sled import clock
from sled.v1 import verifier_pb2 as pb
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from verify_server import errors
from verify_server.acceptance import Outcome
from verify_server.auth import Identity
from verify_server.engines.kv import SessionKV
from verify_server.warp import new_generator

log = logging.getLogger("sled.server")


@dataclass(frozen=True, slots=True)
class Fed:
    """What a verify's forward wrote into a session's KV (recorded on the engine thread): its
    tokens, the last committed token then the draft, at the positions from `start`."""
    start: int
    tokens: Sequence[int]


@dataclass(slots=True, eq=False)
class Session:
    prompt_ids: list[int]
    sampling: Sampling
    max_new_tokens: int
    end_ids: frozenset[int]          # EOS (unless ignored) and the request's stop ids
    stop_ids: frozenset[int]
    drafter: str = ""
    mode: int = pb.GENERATION_MODE_DEVICE_DRAFTS
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    kv: SessionKV | None = None
    generated: list[int] = field(default_factory=list)
    round: int = 0
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    generator: torch.Generator | None = None
    cached_prompt_tokens: int = 0
    acceptance: float = 0.7                 # moving average of accepted / verified per round
    waiting_since: float | None = None      # waiting for the device's next message since then
    evicted_after: float | None = None      # idle seconds after which the KV was freed
    evicted: asyncio.Event = field(default_factory=asyncio.Event)   # set once evicted: the stream ends
    device: Identity | None = None          # who opened it (auth.Identity): quotas, logs, metrics
    kv_reserved: int = 0                    # KV tokens it holds against its device's share
    loose: Loose | None = None              # opt-in loose verification: NOT lossless
    fed: Fed | None = None                  # the round's row as its forward wrote it (scheduler)
    movable: bool = False                   # the device reads Verdict.placement (Open.movable)
    placement: int = pb.GENERATION_MODE_DEVICE_DRAFTS   # where its tokens come from now
    moved_at: float | None = None           # when it last moved (sled.clock)
    device_rate: float | None = None        # tokens/s while its device drafted (moving average)
    round_at: float | None = None           # when its last round ended (or it opened)

    @classmethod
    def from_open(cls, request: pb.Open, sampling: Sampling, eos_ids: tuple[int, ...],
                  kv: SessionKV, loose: Loose | None = None) -> "Session":
        """The session a checked Open asks for (see validation.check_open)."""
        stop = frozenset(request.stop_ids)
        end = stop if request.ignore_eos else stop | frozenset(eos_ids)
        movable = request.movable and request.mode == pb.GENERATION_MODE_DEVICE_DRAFTS \
            and loose is None
        return cls(prompt_ids=list(request.prompt_ids), sampling=sampling,
                   max_new_tokens=request.max_new_tokens, end_ids=end, stop_ids=stop,
                   drafter=request.drafter, mode=request.mode, kv=kv, loose=loose,
                   movable=movable, placement=request.mode)

    def wait_for_device(self) -> None:
        self.waiting_since = clock.now()

    def heard_from_device(self) -> None:
        self.waiting_since = None

    def idle_for(self, now: float) -> float:
        return 0.0 if self.waiting_since is None else now - self.waiting_since

    def __post_init__(self) -> None:
        self.generator = new_generator(self.sampling)

    @property
    def finished(self) -> bool:
        return self.finish != pb.FINISH_REASON_UNSPECIFIED

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt_ids[-1]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def prefill_tokens(self) -> list[int]:
        """Everything but the last prompt token, which goes in with the first draft."""
        return self.prompt_ids[:-1]

    def verifiable(self, draft_len: int) -> int:
        """Draft tokens worth verifying: with the extra token they must fit max_new_tokens."""
        return max(0, min(draft_len, self.remaining - 1))

    def observe_pace(self, tokens: int, now: float) -> None:
        """A round of its device's drafting ended at `now` with `tokens`: its device's rate."""
        if self.round_at is not None and now > self.round_at:
            rate = tokens / (now - self.round_at)
            self.device_rate = rate if self.device_rate is None else \
                self.device_rate + 0.3 * (rate - self.device_rate)
        self.round_at = now

    def move(self, placement: int, now: float) -> None:
        self.placement, self.moved_at, self.round_at = placement, now, now

    def observe(self, verified: int, accepted: int) -> None:
        """Track how much of this session's drafts the target keeps."""
        if verified:
            self.acceptance += 0.3 * (accepted / verified - self.acceptance)

    def commit(self, outcome: Outcome) -> tuple[list[int], int, int]:
        """Append the verdict's tokens, cut at the first end id or the length limit, and keep the
        KV of the tokens the round fed that stay (keep_kv).

        Returns (emitted, finish reason, accepted draft tokens among the emitted): an EOS inside
        an accepted run drops the draft tokens after it, so they do not count as accepted.
        Raises SessionError (INTERNAL) when the KV kept is not what the output says.
        """
        emitted: list[int] = []
        finish = pb.FINISH_REASON_UNSPECIFIED
        for token in outcome.emitted:
            emitted.append(token)
            if token in self.end_ids:
                finish = pb.FINISH_REASON_STOP if token in self.stop_ids else pb.FINISH_REASON_EOS
                break
            if len(self.generated) + len(emitted) >= self.max_new_tokens:
                finish = pb.FINISH_REASON_LENGTH
                break
        self.generated.extend(emitted)
        self.finish = finish
        if self.kv is not None:
            self.keep_kv(outcome)
        self.round += 1
        return emitted, finish, min(outcome.accepted, len(emitted))

    def keep_kv(self, outcome: Outcome) -> None:
        """Keep the KV of the last token and the accepted draft (the correction or bonus goes
        in with the next draft), then check_kv; all O(1). They must be the first 1 + accepted
        positions the round's forward wrote (a tree's accepted path moved there), as the engine
        thread recorded them apart from the outcome (`fed`): an outcome that keeps more than
        its row (a SAT slot, an unwritten position), or a KV that moved between the forward and
        the commit, ends the session."""
        fed, self.fed = self.fed, None
        kept = 1 + outcome.accepted
        last = outcome.path[-1] if outcome.path else outcome.accepted   # the fed token kept last
        if fed is None:
            raise self.kv_fault("no forward wrote its tokens")
        if self.kv.length != fed.start or max(kept, last + 1) > len(fed.tokens):
            raise self.kv_fault(f"it would keep the KV of {kept} tokens from position "
                                f"{self.kv.length}, up to its row's token #{last}, but its "
                                f"forward wrote {len(fed.tokens)} tokens from position {fed.start}")
        self.kv.commit(kept)
        if not self.finished:
            self.check_kv(fed.tokens[last])

    def check_kv(self, last_fed: int) -> None:
        """While the session goes on, its KV holds the prompt and every generated token but the
        last (fed with the next draft), and its last position was fed `last_fed`, the token the
        output has there. This catches a prefill that kept more or less than the prompt, a round
        that emitted other than accepted + 1 tokens without finishing, and an output whose last
        accepted token is not the one whose KV was kept (only that position is compared): each
        would shift or corrupt every later position, so the session ends here. It cannot see
        which KV sits in a slot (a tree's accepted nodes left unmoved pass). A finished
        session's KV is freed unread."""
        context = len(self.prompt_ids) + len(self.generated)
        if self.kv.length != context - 1:
            raise self.kv_fault(f"its KV holds {self.kv.length} tokens, not the {context - 1} of "
                                "its prompt and output but the last")
        position = self.kv.length - 1
        held = (self.prompt_ids[position] if position < len(self.prompt_ids)
                else self.generated[position - len(self.prompt_ids)])
        if held != last_fed:
            raise self.kv_fault(f"position {position} of its KV was fed token {last_fed}, its "
                                f"output has {held} there")

    def kv_fault(self, fault: str) -> errors.SessionError:
        """The session's KV is not its context after this round: a fault in the server, which
        ends this session only (INTERNAL) and is logged for the operator."""
        message = (f"session {self.id} ends after round {self.round}, whose verdict is not "
                   f"sent: {fault}; a fault in the server: reopen with the prompt and the tokens "
                   "received")
        log.error("%s", message)
        return errors.internal(message, self.round)
