"""Work a session puts into the next batched forward: its prompt prefill, or a draft to verify."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from sled.sampling import warp
from verify_server.acceptance import Outcome, DraftQ, verify_greedy, verify_sampling
from verify_server.engine import Row
from verify_server.session import Session


@dataclass(slots=True, eq=False)
class Work:
    session: Session
    future: asyncio.Future | None   # None until the scheduler queues it
    deadline: float | None = None        # perf_counter time after which the work is useless
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def tokens_wanted(self) -> int:
        """Tokens this work would put into the next forward if the budget allowed."""
        raise NotImplementedError

    def row(self, budget: int) -> Row:
        raise NotImplementedError

    def complete(self, logits: torch.Tensor | None):
        """Runs on the engine thread right after the forward; the result resolves `future`."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return True


@dataclass(slots=True, eq=False)
class Prefill(Work):
    """The prompt (all but its last token) into the session's KV, in chunks of the step budget."""

    @property
    def tokens_wanted(self) -> int:
        return len(self.session.prompt_ids) - 1 - self.session.kv.length

    def row(self, budget: int) -> Row:
        start = self.session.kv.length
        return Row(self.session.kv, self.session.prompt_ids[start:start + budget], want_logits=False)

    def complete(self, logits: torch.Tensor | None) -> None:
        if self.done:
            self.session.kv.publish(self.session.prompt_ids)
        return None

    @property
    def done(self) -> bool:
        return self.tokens_wanted <= 0


@dataclass(slots=True, eq=False)
class Verify(Work):
    draft: list[int] = field(default_factory=list)       # [k], already cut to the budget
    q: list[DraftQ] | None = None
    lookahead: int = 0                                   # m SAT slots after the draft

    @property
    def tokens_wanted(self) -> int:
        return len(self.draft) + 1 + self.lookahead

    def row(self, budget: int) -> Row:
        return Row(self.session.kv, [self.session.last_token, *self.draft], want_logits=True,
                   sat_slots=self.lookahead)

    def complete(self, logits: torch.Tensor | None) -> Outcome:
        """logits: [k + 1 + m, vocab]. Decide acceptance on the first k + 1, read SAT hints from
        the last m when the whole draft survived, and drop the rejected tokens' and SATs' KV."""
        session, k = self.session, len(self.draft)
        kept_before = session.kv.length - k - 1 - self.lookahead
        if session.sampling.greedy:
            outcome = verify_greedy(logits[:k + 1], self.draft)
        else:
            p = warp(logits[:k + 1], session.sampling)  # [k + 1, vocab]
            outcome = verify_sampling(p, self.draft, self.q, session.generator)
        if self.lookahead and outcome.accepted == k:
            # SAT slot 1 stands for the bonus token; each slot guesses the token after its own.
            outcome = Outcome(outcome.accepted, outcome.emitted, logits[k + 1:].argmax(-1).tolist())
        # The last committed token and the accepted draft stay; the new last token goes in next round.
        session.kv.truncate(kept_before + 1 + outcome.accepted)
        return outcome
