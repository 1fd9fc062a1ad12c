"""A generation session on the server: what the device asked for and what has been committed."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from sled.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from verify_server.acceptance import Outcome
from verify_server.kv import SessionKV


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

    def wait_for_device(self) -> None:
        self.waiting_since = time.monotonic()

    def heard_from_device(self) -> None:
        self.waiting_since = None

    def idle_for(self, now: float) -> float:
        return 0.0 if self.waiting_since is None else now - self.waiting_since

    def __post_init__(self) -> None:
        if not self.sampling.greedy:
            self.generator = torch.Generator()
            if self.sampling.seed is not None:
                self.generator.manual_seed(self.sampling.seed)
            else:
                self.generator.seed()

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

    def verify_budget(self, draft_len: int) -> int:
        """Draft tokens worth verifying: with the extra token they must fit max_new_tokens."""
        return min(draft_len, self.remaining - 1)

    def observe(self, verified: int, accepted: int) -> None:
        """Track how much of this session's drafts the target keeps."""
        if verified:
            self.acceptance += 0.3 * (accepted / verified - self.acceptance)

    def commit(self, outcome: Outcome) -> tuple[list[int], int, int]:
        """Append the verdict's tokens, cut at the first end id or the length limit.

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
        self.round += 1
        self.finish = finish
        return emitted, finish, min(outcome.accepted, len(emitted))
