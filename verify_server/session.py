"""A generation session on the server: what the device asked for and what has been committed."""
from __future__ import annotations

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
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    kv: SessionKV = field(default_factory=SessionKV)
    generated: list[int] = field(default_factory=list)
    round: int = 0
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    generator: torch.Generator | None = None

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
