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

from drafters.base import Drafter, Proposal
from drafters.wrapper import Wrapper
from sled.wire.sampling import Sampling


class SharedDrafter(Wrapper):
    """Proposals take turns under a lock. Not under it: an emulated drafter's apropose()
    (stateless), and observe() (a drafter that observes locks its own table)."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__(drafter)
        self._lock = threading.Lock()

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, **options) -> Proposal:
        with self._lock:
            return self.inner.propose(context, draft_len, sampling, generator, **options)

    def rollback(self, length: int) -> None:
        """Left to the next proposal's prefix match (see the module doc)."""
