"""The drafter protocol: propose k tokens (with the q they were drawn from) and roll back."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sled.sampling import Sampling


@dataclass(frozen=True, slots=True)
class SparseQ:
    """q at one draft position: the ids the drafter could have drawn and their probabilities."""
    ids: list[int]
    probs: list[float]


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: list[int]              # [k]
    q: list[SparseQ] | None = None    # [k], or None when the drafter is deterministic


@runtime_checkable
class Drafter(Protocol):
    name: str
    # sha256 of the drafter's tokenizer (sled.fingerprint), or None when it has none of its own
    # (the n-gram drafter drafts in the target's ids).
    tokenizer_fingerprint: str | None

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        """Draft k >= 1 tokens continuing `context` (prompt + committed tokens)."""
        ...

    def rollback(self, length: int) -> None:
        """Forget any state past the first `length` context tokens (after a verdict)."""
        ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: common_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
