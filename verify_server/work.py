"""Work a session puts into the next batched forward: its prompt prefill, or a draft to verify."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from sled.sampling import warp
from verify_server.acceptance import Outcome, SparseQ, verify_greedy, verify_sampling
from verify_server.engine import Row
from verify_server.session import Session


@dataclass(slots=True, eq=False)
class Work:
    session: Session
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)

    def row(self) -> Row:
        raise NotImplementedError

    def complete(self, logits: torch.Tensor | None):
        """Runs on the engine thread right after the forward; the result resolves `future`."""
        raise NotImplementedError


@dataclass(slots=True, eq=False)
class Prefill(Work):
    def row(self) -> Row:
        return Row(self.session.kv, self.session.prefill_tokens(), want_logits=False)

    def complete(self, logits: torch.Tensor | None) -> None:
        return None


@dataclass(slots=True, eq=False)
class Verify(Work):
    draft: list[int] = field(default_factory=list)       # [k], already cut to the budget
    q: list[SparseQ] | None = None

    def row(self) -> Row:
        return Row(self.session.kv, [self.session.last_token, *self.draft], want_logits=True)

    def complete(self, logits: torch.Tensor | None) -> Outcome:
        """logits: [k + 1, vocab]. Decide acceptance and drop the rejected tokens' KV."""
        session = self.session
        kept_before = session.kv.length - len(self.draft) - 1
        if session.sampling.greedy:
            outcome = verify_greedy(logits, self.draft)
        else:
            p = warp(logits, session.sampling)  # [k + 1, vocab]
            outcome = verify_sampling(p, self.draft, self.q, session.generator)
        # The last committed token and the accepted draft stay; the new last token goes in next round.
        session.kv.truncate(kept_before + 1 + outcome.accepted)
        return outcome
