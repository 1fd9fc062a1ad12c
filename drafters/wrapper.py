"""A drafter around another that drafts the inner drafter's tokens: what the device's shared and
paced drafters (edge_client) have in common."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafters.base import Drafter, Proposal
from drafters.capabilities import NONE, Capabilities, passed_on
from sled.wire.sampling import Sampling


class Wrapper:
    """The inner drafter's name, alias (the built-in alias it was loaded from) and tokenizer, and
    of its capabilities those in FORWARDS, which the methods below pass on, plus the wrapper's
    OWN. A subclass changes how a proposal runs (under a lock, at a board's pace)."""

    FORWARDS = Capabilities(confidence=True, trees=True, observes=True, awaitable=True)
    OWN = NONE

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.alias = getattr(inner, "alias", None)    # set by load_drafter for an alias only
        self.tokenizer_fingerprint = inner.tokenizer_fingerprint

    @property
    def capabilities(self) -> Capabilities:
        return passed_on(self.inner, self.FORWARDS, self.OWN)

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, **options) -> Proposal:
        return self.inner.propose(context, draft_len, sampling, generator, **options)

    async def apropose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                       generator: np.random.Generator | None = None, **options) -> Proposal:
        """The inner drafter's own apropose() (capabilities.awaitable)."""
        return await self.inner.apropose(context, draft_len, sampling, generator, **options)

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)

    def observe(self, context: Sequence[int]) -> None:
        """The inner drafter's observe() (capabilities.observes)."""
        self.inner.observe(context)
