"""Model-free drafting by prompt lookup: continue the context the way it continued before.

Example: context [7, 1, 2, 3, 9, 1, 2] -> the trailing n-gram [1, 2] last occurred at index 1,
followed by [3, 9, ...], so the draft starts 3, 9, 1, 2, ...
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafters.base import Proposal
from drafters.capabilities import Capabilities
from sled.wire.sampling import Sampling


class NgramDrafter:
    tokenizer_fingerprint = None  # drafts in the target's own ids
    capabilities = Capabilities()  # a chain, all of it always: nothing to stop on or branch

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = f"ngram:{max_ngram}"

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None) -> Proposal:
        tokens = list(context)
        draft: list[int] = []
        while len(draft) < draft_len:
            # No earlier match: guess the last token repeats (cheap, and never an empty draft).
            continuation = self._lookup(tokens, draft_len - len(draft)) or [tokens[-1]]
            draft.extend(continuation)
            tokens.extend(continuation)
        return Proposal(draft[:draft_len])  # deterministic: q = one-hot

    def rollback(self, length: int) -> None:
        """Stateless: nothing to roll back."""

    def _lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = tokens[end - n:]
            for start in range(end - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + limit]
        return []
