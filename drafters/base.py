"""The drafter protocol: propose k tokens (with the q they were drawn from) and roll back."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from sled.sampling import Sampling, warp


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


def choose_token(logits: torch.Tensor | np.ndarray, sampling: Sampling, q_support: int,
                 generator: torch.Generator | None = None) -> tuple[int, SparseQ | None]:
    """One draft token from logits [vocab] (torch or numpy): the argmax, or a draw with its q."""
    if sampling.greedy:
        return int(logits.argmax()), None
    # Sample from the warped distribution truncated to q_support ids: that truncated q is
    # exactly what was sampled from, so the server's rejection sampling stays exact.
    probs = warp(torch.as_tensor(logits), sampling)
    top = torch.topk(probs, min(q_support, probs.shape[-1]))
    support = top.values[top.values > 0]
    ids = top.indices[: len(support)]
    q = support / support.sum()
    pick = int(torch.multinomial(q, 1, generator=generator))
    return int(ids[pick]), SparseQ(ids.tolist(), q.float().tolist())
