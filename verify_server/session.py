"""A generation session on the server: what the device asked for and what has been committed.

The session owns its committed state: the tokens generated so far and, through `commit`, how
much of its KV is context. Nothing else moves either after the prompt is in."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import torch

from sled import clock
from sled.v1 import verifier_pb2 as pb
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from verify_server.acceptance import Outcome
from verify_server.auth import Identity
from verify_server.engines.kv import SessionKV
from verify_server.warp import new_generator


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

    @classmethod
    def from_open(cls, request: pb.Open, sampling: Sampling, eos_ids: tuple[int, ...],
                  kv: SessionKV, loose: Loose | None = None) -> "Session":
        """The session a checked Open asks for (see validation.check_open)."""
        stop = frozenset(request.stop_ids)
        end = stop if request.ignore_eos else stop | frozenset(eos_ids)
        return cls(prompt_ids=list(request.prompt_ids), sampling=sampling,
                   max_new_tokens=request.max_new_tokens, end_ids=end, stop_ids=stop,
                   drafter=request.drafter, mode=request.mode, kv=kv, loose=loose)

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

    def observe(self, verified: int, accepted: int) -> None:
        """Track how much of this session's drafts the target keeps."""
        if verified:
            self.acceptance += 0.3 * (accepted / verified - self.acceptance)

    def commit(self, outcome: Outcome) -> tuple[list[int], int, int]:
        """Append the verdict's tokens, cut at the first end id or the length limit, and keep the
        KV of the tokens the round fed that stay: the last token and the accepted draft (the
        correction or bonus goes in with the next draft).

        Returns (emitted, finish reason, accepted draft tokens among the emitted): an EOS inside
        an accepted run drops the draft tokens after it, so they do not count as accepted.
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
        if self.kv is not None:
            self.kv.commit(1 + outcome.accepted)
        self.round += 1
        self.finish = finish
        self.check_kv()
        return emitted, finish, min(outcome.accepted, len(emitted))

    def check_kv(self) -> None:
        """While the session goes on, its KV holds the prompt and every generated token but the
        last (fed with the next draft). A round that kept a rejected token's KV, or lost an
        accepted one's, would shift every later position: the session ends here instead of
        emitting what the target would not have. A finished session's KV is freed unread."""
        if self.kv is None or self.finished:
            return
        seen = len(self.prompt_ids) + len(self.generated) - 1
        if self.kv.length != seen:
            raise RuntimeError(f"session {self.id}'s KV holds {self.kv.length} tokens after "
                               f"round {self.round}, not the {seen} of its prompt and output but "
                               "the last")
