"""Pipelined drafting: while a verdict is in flight, keep drafting on the optimistic path.

The optimistic path assumes the draft in flight is accepted whole and that the target's bonus
token is the drafter's own most likely next token (the guess). Example: after context c the
draft [5, 6] is in flight; the guess is 7, the drafter's argmax after c + [5, 6]; then 8, 9 are
drafted after c + [5, 6, 7]. A verdict that accepts 5 and 6 and emits bonus 7 commits exactly
c + [5, 6, 7], so the next draft starts with [8, 9] and only the rest of it is drafted after the
verdict. Any other verdict discards them.

Lossless either way: the server verifies every draft token. In sampling mode a kept token was
drawn from q given the context it is verified in (the guess only decides whether it is kept,
and the target's bonus draw is independent of it), and it is sent with that q, so rejection
sampling stays exact. Seeded sampling sessions do not pipeline (see DeviceSession).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from drafters.base import Proposal, SparseQ
from sled.wire.sampling import Sampling

log = logging.getLogger(__name__)

# step(context, sampling) -> a one-token proposal continuing context
Step = Callable[[list[int], Sampling], Awaitable[Proposal]]
GREEDY = Sampling()


class Speculation:
    """Drafting after one draft in flight, one token at a time, so that it stops soon after
    the verdict arrives (stop()), once `cap` tokens are ready, or right after a token the drafter
    is less sure of than min_confidence (that token ends the next draft, as an early stop would).
    A drafter error (a trace off its recorded path, a full context) just ends it: speculation is
    an optimisation, never a failure.
    """

    def __init__(self, step: Step, base: Sequence[int], in_flight: int, cap: int,
                 sampling: Sampling, min_confidence: float = 0.0) -> None:
        self.in_flight = in_flight          # tokens of the draft the verdict is for
        self.guess: int | None = None       # the bonus token the speculation assumes
        self.tokens: list[int] = []         # drafted after base + [guess]
        self.q: list[SparseQ] = []
        self.confidence: list[float] = []
        self.ended = False                  # the last token is an early stop: the next draft ends there
        self._stopping = False
        self._task = asyncio.ensure_future(self._run(step, list(base), cap, sampling, min_confidence))

    async def _run(self, step: Step, path: list[int], cap: int, sampling: Sampling,
                   min_confidence: float) -> None:
        try:
            # The guess: the drafter's most likely token, which is what the bonus most often is.
            self.guess = (await step(path, GREEDY)).token_ids[0]
            path.append(self.guess)
            while not self._stopping and len(self.tokens) < cap:
                proposal = await step(path, sampling)
                self._take(proposal)
                path.append(proposal.token_ids[0])
                if proposal.confidence and proposal.confidence[0] < min_confidence:
                    self.ended = True
                    return
        except Exception as exc:  # off the drafter's path or out of its context: stop here
            log.debug("speculative drafting stopped: %s", exc)

    def _take(self, proposal: Proposal) -> None:
        """Keep one drafted token with its q and confidence."""
        self.tokens.append(proposal.token_ids[0])
        if proposal.q:
            self.q.append(proposal.q[0])
        if proposal.confidence:
            self.confidence.append(proposal.confidence[0])

    async def finish(self) -> None:
        """Stop after the step in flight: the drafter is busy until it ends (a real drafter's
        forward cannot be interrupted), then free for the next draft or a rollback."""
        self._stopping = True
        await self._task

    def kept(self, accepted: int, emitted: Sequence[int]) -> Proposal | None:
        """The pre-drafted tokens that start the next draft, if the verdict (accepted draft
        tokens, emitted tokens) went the optimistic way: the whole draft accepted and the
        bonus equal to the guess. None otherwise, or when nothing was pre-drafted."""
        whole = accepted == self.in_flight and len(emitted) == self.in_flight + 1
        if not whole or emitted[-1] != self.guess or not self.tokens:
            return None
        n = len(self.tokens)
        return Proposal(list(self.tokens), list(self.q) if len(self.q) == n else None,
                        list(self.confidence) if len(self.confidence) == n else None)

