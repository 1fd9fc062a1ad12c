"""The drafter protocol: propose a draft (with the q it was drawn from) and roll back."""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import tokenizers

from drafters.capabilities import Capabilities, capabilities_of
from sled.cache import write_atomically
from sled.wire.fingerprint import fingerprint_vocab
from sled.wire.keyed import keyed_pick
from sled.wire.sampling import Sampling, warp
from sled.wire.tree import chain_parents, is_chain

FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")  # what sled.wire.fingerprint makes


@dataclass(frozen=True, slots=True)
class SparseQ:
    """q at one draft position: the ids the drafter could have drawn and their probabilities."""
    ids: list[int]
    probs: list[float]


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: list[int]              # [draft_len]
    q: list[SparseQ] | None = None    # [draft_len], or None when the drafter is deterministic
    # [draft_len]: the drafter's probability of each token it drafted (greedy: its softmax max; sampling:
    # q of the drawn token), or None when it was not asked for or the drafter has none
    confidence: list[float] | None = None
    # [draft_len]: a tree draft's parent indices (sled.wire.tree: 0 = the context's last token, i =
    # token_ids[i - 1]); None for a chain. A tree's q is None (deterministic candidates).
    parents: list[int] | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str
    # sha256 of the drafter's tokenizer (sled.wire.fingerprint), or None when it has none of its own
    # (the n-gram drafter drafts in the target's ids).
    tokenizer_fingerprint: str | None
    # what it can do beyond propose() and rollback() (drafters.capabilities), read through
    # capabilities_of(): declared on its class
    capabilities: Capabilities

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None) -> Proposal:
        """Draft draft_len >= 1 tokens continuing `context` (prompt + committed tokens)."""
        ...

    def rollback(self, length: int) -> None:
        """Forget any state past the first `length` context tokens (after a verdict)."""
        ...


# Shorthands of capabilities_of(drafter).confidence and .trees, for the lab's callers.
def reports_confidence(drafter) -> bool:
    """Whether drafter.propose() takes min_confidence / with_confidence (Capabilities.confidence)."""
    return capabilities_of(drafter).confidence


def drafts_trees(drafter) -> bool:
    """Whether drafter.propose() takes tree=N (Capabilities.trees)."""
    return capabilities_of(drafter).trees


def tree_proposal(tokens: list[int], parents: list[int]) -> Proposal:
    """A proposal of a tree; one that did not branch is sent as the plain chain it is."""
    return Proposal(tokens, parents=None if is_chain(parents) else parents)


def confidence_options(drafter, min_confidence: float) -> dict:
    """The keywords to pass propose() for an early stop at min_confidence: none when it is 0 or
    the drafter has no confidence to stop on (n-gram, a trace recorded without confidences)."""
    if min_confidence > 0 and capabilities_of(drafter).confidence:
        return {"min_confidence": min_confidence}
    return {}


def stop_index(confidence: Sequence[float], min_confidence: float) -> int:
    """How many drafted tokens an early stop keeps: up to and including the first token whose
    confidence is below min_confidence (it is drawn already, so it costs nothing to send; what
    the stop saves is drafting after it). stop_index([0.9, 0.3, 0.8], 0.5) == 2."""
    for i, c in enumerate(confidence):
        if c < min_confidence:
            return i + 1
    return len(confidence)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: common_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def choose_token(logits: np.ndarray, sampling: Sampling, q_support: int,
                 generator: np.random.Generator | None = None,
                 position: int | None = None) -> tuple[int, SparseQ | None]:
    """One draft token from logits [vocab]: the argmax, or a draw with its q. A seeded request's
    draw at sequence position POSITION is the keyed rule's (sled.wire.keyed), the one the target
    makes by the same rule from p: the closer q is to p, the likelier they agree."""
    if sampling.greedy:
        return int(np.argmax(logits)), None
    # Sample from the warped distribution truncated to q_support ids: that truncated q is
    # exactly what was sampled from, so the server's rejection sampling stays exact.
    ids, q = truncated_q(warp(logits, sampling), q_support)
    if sampling.seed is not None and position is not None:
        return keyed_pick(ids, q, sampling.seed, position), SparseQ(ids.tolist(), q.tolist())
    rng = generator if generator is not None else np.random.default_rng()
    cumulative = np.cumsum(q)                                   # [support]
    pick = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")),
               len(ids) - 1)
    return int(ids[pick]), SparseQ(ids.tolist(), q.tolist())


def truncated_q(probs: np.ndarray, q_support: int) -> tuple[np.ndarray, np.ndarray]:
    """The q_support most likely ids of probs [vocab] with nonzero probability, most likely
    first (equal ones: lower id first), and their probabilities renormalised: ([n], [n] float64).
    Of ids tied at the cut, which are kept is argpartition's choice (fixed for given probs)."""
    n = min(q_support, probs.shape[-1])
    top = np.argpartition(probs, probs.shape[-1] - n)[-n:]      # [n] the n most likely, any order
    top = top[np.lexsort((top, -probs[top]))]                   # most likely first
    top = top[probs[top] > 0]
    support = probs[top].astype(np.float64)
    return top, support / support.sum()


def token_confidence(logits: np.ndarray, token: int, q: SparseQ | None) -> float:
    """The drafter's probability of the token it drafted from logits [vocab]: q(token) when it
    was sampled, else (greedy) the softmax maximum, 1 / sum(exp(logits - max))."""
    if q is not None:
        return q.probs[q.ids.index(token)]
    scores = np.asarray(logits, dtype=np.float64)
    return 1.0 / float(np.exp(scores - scores.max()).sum())


# Below this probability of its top token a model drafter (tree=N) adds its next N - 1 tokens as
# siblings: above it, the top token is accepted often enough that a sibling rarely pays its slot.
TREE_CONFIDENCE = 0.5


def unsure_alternatives(logits: np.ndarray, n: int) -> list[int]:
    """The n ids after the top one in logits [vocab], most likely first, when the top id has less
    than TREE_CONFIDENCE of the softmax; [] when the drafter is sure."""
    scores = np.asarray(logits, dtype=np.float64)
    if 1.0 / float(np.exp(scores - scores.max()).sum()) >= TREE_CONFIDENCE:
        return []
    top = np.argpartition(scores, scores.shape[-1] - n - 1)[-n - 1:]
    top = top[np.lexsort((top, -scores[top]))]                  # most likely first
    return [int(t) for t in top[1:]]


def drafter_threads(n_threads: int | None) -> int | None:
    """Threads for a drafter runtime: the argument, else $SLED_DRAFTER_THREADS, else the runtime's."""
    return n_threads or int(os.environ.get("SLED_DRAFTER_THREADS") or 0) or None


class KVDrafter:
    """The loop every model drafter shares: keep the KV of the tokens seen, feed only what is new.

    A proposal reuses the cached prefix of the context (at least the last context token is fed
    again, for fresh logits), then drafts draft_len tokens one at a time; rollback() drops the KV
    past the committed length. Subclasses run the model (_run) and truncate its cache (_truncate).
    """

    q_support: int = 32
    capacity: int | None = None          # most tokens the runtime's cache holds
    capacity_name: str = "context"       # what the runtime calls that limit
    # min_confidence / with_confidence, and tree=N (siblings where it is unsure); a runtime with
    # _run_tail adds checks_guesses (greedy_after() in one evaluation)
    capabilities = Capabilities(confidence=True, trees=True)

    def __init__(self) -> None:
        self._seen: list[int] = []       # tokens whose keys/values are cached
        self.evaluated = 0               # tokens run through the model so far

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, *, min_confidence: float = 0.0,
                with_confidence: bool = False, tree: int = 1) -> Proposal:
        """Draft up to draft_len tokens; with min_confidence > 0 the draft ends after the first token the
        drafter is less sure of than that (at least one token is always drafted). tree=N > 1
        (greedy): wherever the drafter's top token has less than TREE_CONFIDENCE of its
        probability, its next N - 1 tokens join the draft as leaves beside it (siblings), so the
        target may take one of them instead."""
        if self.capacity is not None and len(context) + draft_len - 1 > self.capacity:
            raise ValueError(f"{len(context)} context + {draft_len} draft tokens exceed the drafter's "
                             f"{self.capacity_name} {self.capacity}")
        logits = self._feed(self._unseen(context))
        scored = with_confidence or min_confidence > 0
        branch = tree > 1 and sampling.greedy
        draft: list[int] = []
        qs: list[SparseQ] = []
        confidence: list[float] = []
        siblings: list[tuple[int, int]] = []     # (token, parent node) of each leaf beside the chain
        for j in range(draft_len):
            token, q = choose_token(logits, sampling, self.q_support, generator,
                                    position=len(context) + j)
            if branch:
                siblings += [(s, j) for s in unsure_alternatives(logits, tree - 1)]
            draft.append(token)
            if q is not None:
                qs.append(q)
            if scored:
                confidence.append(token_confidence(logits, token, q))
                if confidence[-1] < min_confidence:
                    break          # unsure here: tokens after this one would rarely be accepted
            if j + 1 < draft_len:
                logits = self._feed([token])
        if siblings:
            return Proposal(draft + [s for s, _ in siblings], None, None,
                            chain_parents(len(draft)) + [parent for _, parent in siblings])
        return Proposal(draft, qs if qs else None, confidence if scored else None)

    def rollback(self, length: int) -> None:
        if length < len(self._seen):
            del self._seen[self._truncate(length):]

    def greedy_after(self, context: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """The drafter's greedy token after `context` and after each prefix of `tokens`
        ([len(tokens) + 1]), from one evaluation: how a cheaper drafter's guesses are checked."""
        if self.capacity is not None and len(context) + len(tokens) > self.capacity:
            raise ValueError(f"{len(context)} context + {len(tokens)} checked tokens exceed the "
                             f"drafter's {self.capacity_name} {self.capacity}")
        fed = self._unseen(context) + list(tokens)
        logits = self._run_tail(fed, len(tokens) + 1)
        self._seen.extend(fed)
        self.evaluated += len(fed)
        return np.asarray(logits).argmax(axis=-1).tolist()

    def _unseen(self, context: Sequence[int]) -> list[int]:
        """Roll back to the cached prefix of context (keeping at least its last token to feed
        again, for fresh logits) and return the tokens still to feed."""
        keep = min(common_prefix(self._seen, context), len(context) - 1)
        self.rollback(keep)
        return list(context[keep:])

    def _feed(self, tokens: list[int]):
        logits = self._run(tokens)
        self._seen.extend(tokens)
        self.evaluated += len(tokens)
        return logits

    def _run(self, tokens: list[int]):
        """Evaluate tokens at positions len(self._seen)...; the logits after the last: [vocab]."""
        raise NotImplementedError

    def _run_tail(self, tokens: list[int], rows: int):
        """Evaluate tokens like _run; the logits after each of the last `rows`: [rows, vocab]."""
        raise NotImplementedError

    def _truncate(self, length: int) -> int:
        """Drop cached positions >= length; returns the length actually kept."""
        raise NotImplementedError


# -- a drafter's tokenizer fingerprint, cached on disk (computing one takes seconds) -------------

def tokenizer_json_fingerprint(path: Path) -> str:
    """sled.wire.fingerprint of a tokenizer.json read with the `tokenizers` library: the same
    (id, token) table transformers' tokenizer of that file reports, added tokens included,
    without importing transformers (a few seconds for gemma3's 33 MB file, not ten)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    return fingerprint_vocab(tokenizer.get_vocab(with_added_tokens=True))


def _entry_digest(key: str, fingerprint: str) -> str:
    return hashlib.sha256(f"{key}\n{fingerprint}".encode("utf-8", "surrogatepass")).hexdigest()


def read_fingerprint(file: Path, key: str) -> str | None:
    """The fingerprint cached in FILE for KEY, or None when the entry is missing or not whole
    (it names its key, holds a well-formed fingerprint and a sha256 of both)."""
    try:
        entry = json.loads(file.read_text())
        fingerprint = entry["fingerprint"]
        if entry["key"] == key and FINGERPRINT.fullmatch(fingerprint) and \
                entry["sha256"] == _entry_digest(key, fingerprint):
            return fingerprint
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_fingerprint(file: Path, key: str, fingerprint: str) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "fingerprint": fingerprint, "sha256": _entry_digest(key, fingerprint)}
    write_atomically(file, json.dumps(entry).encode())  # a concurrent reader sees all or nothing
