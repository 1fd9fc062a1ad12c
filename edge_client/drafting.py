"""One drafter shared by every session of the device.

A drafter holds the KV of one context at a time, so concurrent sessions take turns: each
proposal runs under a lock, and the drafter itself reuses the longest cached prefix of the
context it is given (KVDrafter), feeding only what differs. Rollbacks are left to that prefix
match: one session's rollback must not throw away the state another session is using.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from drafters.base import Drafter, Proposal, drafts_trees, observes_context, reports_confidence
from sled.wire.sampling import Sampling


class SharedDrafter:
    def __init__(self, drafter: Drafter) -> None:
        self.inner = drafter
        self.name = drafter.name
        self.alias = getattr(drafter, "alias", None)     # the built-in alias it was loaded from
        self.tokenizer_fingerprint = drafter.tokenizer_fingerprint
        self._lock = threading.Lock()
        if hasattr(drafter, "apropose"):      # emulated drafters: stateless, awaited directly
            self.apropose = drafter.apropose
        if observes_context(drafter):         # it locks its own table
            self.observe = drafter.observe

    @property
    def reports_confidence(self) -> bool:
        """Whether the shared drafter takes min_confidence (an early stop)."""
        return reports_confidence(self.inner)

    @property
    def drafts_trees(self) -> bool:
        """Whether the shared drafter takes tree=N."""
        return drafts_trees(self.inner)

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, **options) -> Proposal:
        with self._lock:
            return self.inner.propose(context, draft_len, sampling, generator, **options)

    def rollback(self, length: int) -> None:
        """Left to the next proposal's prefix match (see the module doc)."""
