"""Synthetic drafter traces: a stated acceptance process instead of a drafter, for targets whose
text means nothing (synthetic:NAME, random weights) or drafters that cannot run here.

A device drafting with such a trace proposes, at every position of the target's greedy output,
the target's own next token with probability a_1; given that, the one after it with probability
a_2; and so on (a_j past the profile's end is its last value). The first token it gets wrong is
another id, and so is every token after it. The target's output comes from the server's own
server mode (GENERATION_MODE_SERVER), so a replay checks every device output against what the
same server produces for the same prompt.

The profile comes from a stated source: measured from a recorded trace of a real pair
(`acceptance_profile`, e.g. gguf:gemma3-270m drafting for gemma3-270m), or given.

    profile [0.9, 0.8], output [5, 6, 7]: after the prompt the draft is 5 with p 0.9, then 6 with
    p 0.8 (given 5); each draft is drawn once, from the seed, and kept in the trace.

    drafter = SyntheticDrafter([0.9, 0.8], max_draft_len=4, seed=0, source="given")
    traces = synthetic_trace_set(prompts, outputs, drafter, vocab_size, target, fingerprint)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from drafters.base import common_prefix
from lab.traces.format import Trace, TraceSet


def acceptance_profile(traces: TraceSet, max_draft_len: int) -> list[float]:
    """The conditional acceptance at each of the first max_draft_len draft positions of recorded traces:
    of the proposals whose first j tokens are the target's, the share whose token j + 1 is too
    (counted only where the target's output goes on that far)."""
    reached, kept = np.zeros(max_draft_len), np.zeros(max_draft_len)
    for trace in traces.traces:
        for i, proposal in enumerate(trace.proposals):
            truth = trace.target_ids[i:i + max_draft_len]
            run = common_prefix(proposal[:max_draft_len], truth)
            seen = min(len(proposal), len(truth), max_draft_len)
            for j in range(min(run + 1, seen)):
                reached[j] += 1
                kept[j] += j < run
    if not reached[0]:
        raise ValueError("the traces hold no proposals to measure acceptance from")
    measured = [round(float(k / r), 4) for k, r in zip(kept, reached) if r]
    if len(measured) < max_draft_len:   # positions no trace reached (a shorter max_draft_len when recorded)
        raise ValueError(f"the traces show acceptance at {len(measured)} draft positions, not "
                         f"{max_draft_len}: synthesize with --max-draft-len {len(measured)} or record longer drafts")
    return measured


def profile_for_share(share: float, k: int) -> list[float]:
    """The one acceptance a, at every draft position, whose drafts of k tokens keep `share` of
    their tokens on average: share = (a + a^2 + ... + a^k) / k, since a token is kept only
    after every one before it. A share of 0.6 at k = 4 gives a = 0.81 (not 0.6)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"an accepted share is in [0, 1], got {share}")
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        if sum(a ** j for j in range(1, k + 1)) / k < share:
            low = a
        else:
            high = a
    return [round((low + high) / 2, 4)]


def check_profile(profile: Sequence[float]) -> list[float]:
    """A usable acceptance profile: 1 to 64 probabilities in [0, 1] (ValueError otherwise)."""
    values = [float(a) for a in profile]
    if not 1 <= len(values) <= 64 or not all(0.0 <= a <= 1.0 for a in values):
        raise ValueError(f"an acceptance profile is 1 to 64 probabilities in [0, 1], got {values}")
    return values


def synthetic_trace(prompt: Sequence[int], target_ids: Sequence[int], profile: Sequence[float],
                    max_draft_len: int, vocab_size: int, rng: np.random.Generator,
                    draft_ms_per_token: float = 0.0, drafter: str = "synthetic") -> Trace:
    """One prompt's trace: a draft of max_draft_len drawn by the profile after every prefix of target_ids."""
    proposals = [_draft(target_ids[i:i + max_draft_len], profile, max_draft_len, vocab_size, rng)
                 for i in range(len(target_ids))]
    return Trace(list(prompt), list(target_ids), proposals, draft_ms_per_token, drafter)


def _draft(truth: Sequence[int], profile: Sequence[float], max_draft_len: int, vocab_size: int,
           rng: np.random.Generator) -> list[int]:
    draft: list[int] = []
    for j in range(max_draft_len):
        right = j < len(truth) and rng.random() < profile[min(j, len(profile) - 1)]
        if not right:
            break
        draft.append(int(truth[j]))
    while len(draft) < max_draft_len:       # the first miss and everything after it: other ids
        avoid = truth[len(draft)] if len(draft) < len(truth) else -1
        token = int(rng.integers(vocab_size - 1))
        draft.append(token + 1 if token >= avoid >= 0 else token)
    return draft


@dataclass(frozen=True, slots=True)
class SyntheticDrafter:
    """The stated acceptance process a synthetic trace set is drawn from: a draft of
    max_draft_len after every prefix, drawn by `profile` (the conditional acceptance of draft
    positions 1, 2, ...; the last one repeats) from `seed`. `source` names where the profile
    comes from (kept as the drafter's name, e.g. "synthetic[gguf:gemma3-270m on humaneval]");
    draft_ms_per_token is the drafting time kept in the traces."""
    profile: Sequence[float]
    max_draft_len: int
    seed: int
    source: str
    draft_ms_per_token: float = 0.0

    @property
    def name(self) -> str:
        return f"synthetic[{self.source}]"


def synthetic_trace_set(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                        drafter: SyntheticDrafter, vocab_size: int, target: str,
                        fingerprint: str | None) -> TraceSet:
    """Traces for every prompt, along its output, drawn by `drafter`, for the target named
    `target` (its vocabulary size and tokenizer fingerprint)."""
    rng = np.random.default_rng(drafter.seed)
    name = drafter.name
    traces = [synthetic_trace(p, o, drafter.profile, drafter.max_draft_len, vocab_size, rng,
                              drafter.draft_ms_per_token, name)
              for p, o in zip(prompts, outputs, strict=True)]
    for trace in traces:
        trace.tokenizer_fingerprint = fingerprint
    return TraceSet(target=target, drafter=name, max_draft_len=drafter.max_draft_len,
                    traces=traces, tokenizer_fingerprint=fingerprint)
