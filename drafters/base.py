"""The drafter protocol: propose k tokens (with the q they were drawn from) and roll back."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import os

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


def drafter_threads(n_threads: int | None) -> int | None:
    """Threads for a drafter runtime: the argument, else $SLED_DRAFTER_THREADS, else the runtime's."""
    return n_threads or int(os.environ.get("SLED_DRAFTER_THREADS") or 0) or None


class KVDrafter:
    """The loop every model drafter shares: keep the KV of the tokens seen, feed only what is new.

    A proposal reuses the cached prefix of the context (at least the last context token is fed
    again, for fresh logits), then drafts k tokens one at a time; rollback() drops the KV past
    the committed length. Subclasses run the model (_run) and truncate its cache (_truncate).
    """

    q_support: int = 32
    capacity: int | None = None          # most tokens the runtime's cache holds
    capacity_name: str = "context"       # what the runtime calls that limit

    def __init__(self) -> None:
        self._seen: list[int] = []       # tokens whose keys/values are cached
        self.evaluated = 0               # tokens run through the model so far

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        if self.capacity is not None and len(context) + k - 1 > self.capacity:
            raise ValueError(f"{len(context)} context + {k} draft tokens exceed the drafter's "
                             f"{self.capacity_name} {self.capacity}")
        keep = min(common_prefix(self._seen, context), len(context) - 1)
        self.rollback(keep)
        logits = self._feed(list(context[keep:]))
        draft: list[int] = []
        qs: list[SparseQ] = []
        for j in range(k):
            token, q = choose_token(logits, sampling, self.q_support, generator)
            draft.append(token)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                logits = self._feed([token])
        return Proposal(draft, qs if qs else None)

    def rollback(self, length: int) -> None:
        if length < len(self._seen):
            del self._seen[self._truncate(length):]

    def _feed(self, tokens: list[int]):
        logits = self._run(tokens)
        self._seen.extend(tokens)
        self.evaluated += len(tokens)
        return logits

    def _run(self, tokens: list[int]):
        """Evaluate tokens at positions len(self._seen)...; the logits after the last: [vocab]."""
        raise NotImplementedError

    def _truncate(self, length: int) -> int:
        """Drop cached positions >= length; returns the length actually kept."""
        raise NotImplementedError
