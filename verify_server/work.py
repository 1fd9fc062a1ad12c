"""Work a session puts into the next batched forward: its prompt prefill, or a draft to verify.

`complete` runs on the engine thread right after the forward. It decides; it does not commit a
round: a verified draft's tokens and KV are committed by `Session.commit` when the round
finishes. A prefill chunk is all kept, so it commits its own KV here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from verify_server.acceptance import (DraftQ, Outcome, verify_greedy, verify_greedy_tree,
                                      verify_sampling, verify_sampling_tree)
from verify_server.engine import Row
from verify_server.session import Session
from verify_server.warp import warp


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

    def complete(self, row: Row, logits: torch.Tensor | None):
        """After the forward of `row`; the result resolves `future`."""
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

    def complete(self, row: Row, logits: torch.Tensor | None) -> None:
        self.session.kv.commit(len(row.tokens))
        if self.done:
            self.session.kv.publish(self.session.prompt_ids)
        return None

    @property
    def done(self) -> bool:
        return self.tokens_wanted <= 0


@dataclass(slots=True, eq=False)
class Verify(Work):
    draft: list[int] = field(default_factory=list)       # [draft_len], already cut to what fits
    q: list[DraftQ] | None = None                        # [draft_len], None: deterministic drafter
    lookahead: int = 0                                   # m SAT slots after the draft
    every_cut: bool = False    # SAT slots after every place the draft may be cut, not only its end
    parents: list[int] | None = None    # a tree draft's parent indices (sled.wire.tree); None: a chain

    @property
    def tokens_wanted(self) -> int:
        return sat_step_tokens(len(self.draft), self.lookahead, self.every_cut)

    def row(self, budget: int) -> Row:
        anchors = tuple(range(1, len(self.draft) + 2)) if self.every_cut and self.lookahead else ()
        return Row(self.session.kv, [self.session.last_token, *self.draft], want_logits=True,
                   sat_slots=self.lookahead, sat_anchors=anchors, parents=tuple(self.parents or ()))

    def complete(self, row: Row, logits: torch.Tensor | None) -> Outcome:
        """logits: [draft_len + 1 + blocks * m, vocab]. Decide acceptance on the first
        draft_len + 1; read SAT hints from the block that follows the accepted tokens (with
        every_cut), else from the one block when the whole draft survived."""
        session, draft_len = self.session, len(self.draft)
        if self.parents:        # deterministic candidates only (validation.check_tree)
            if session.sampling.greedy:
                outcome = verify_greedy_tree(logits, self.draft, self.parents)
            else:
                outcome = verify_sampling_tree(warp(logits, session.sampling), self.draft,
                                               self.parents, session.generator)
            session.kv.keep_path(outcome.path)
            return outcome
        if session.sampling.greedy:
            outcome = verify_greedy(logits[:draft_len + 1], self.draft, session.loose)
        else:
            p = warp(logits[:draft_len + 1], session.sampling)  # [draft_len + 1, vocab]
            outcome = verify_sampling(p, self.draft, self.q, session.generator)
        block = outcome.accepted if self.every_cut else 0
        if self.lookahead and (self.every_cut or outcome.accepted == draft_len):
            # SAT slot 1 stands for the correction or bonus token; each slot guesses the token
            # after its own.
            first = draft_len + 1 + block * self.lookahead
            hints = logits[first:first + self.lookahead].argmax(-1).tolist()
            outcome = dataclasses.replace(outcome, hints=hints)
        return outcome


def sat_step_tokens(draft_len: int, lookahead: int, every_cut: bool = False) -> int:
    """Positions a verify puts into a pass: the last token, the draft and its SAT slots (one
    block, or one after every place the draft may be cut)."""
    blocks = draft_len + 1 if every_cut else 1
    return draft_len + 1 + lookahead * blocks
