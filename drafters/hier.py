"""Hierarchical drafting: a cheap drafter drafts for the device's model drafter, which checks
those guesses itself in one batched evaluation before anything goes to the server.

Spec "hier:CHEAP>MODEL", e.g. "hier:cacheback>gguf:gemma3-270m". A greedy draft is exactly the
model drafter's own greedy draft (what it would have drafted token by token), produced in fewer
evaluations when the cheap guesses are right:

    guesses g1 g2 g3 from CHEAP; MODEL evaluates context + g1 g2 g3 at once and reads its own
    greedy token after each prefix: m1 m2 m3 m4. The draft takes g1.. while gi == mi, then MODEL's
    own token at the first difference (or m4 when all agree), and goes on from there.

Sampled requests draft from the model drafter alone (its q is what the server's rejection
sampling needs), so sampling stays exact.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafters.base import KVDrafter, Proposal, common_prefix
from drafters.capabilities import Capabilities, capabilities_of, passed_on
from sled.wire.sampling import Sampling

GREEDY = Sampling()


class HierDrafter:
    # what it forwards of the cheap drafter's: its observe(); its own propose() takes no options
    FORWARDS = Capabilities(observes=True)

    def __init__(self, cheap, model: KVDrafter) -> None:
        if not capabilities_of(model).checks_guesses:
            raise ValueError(f"hier: the checking drafter {model.name!r} cannot check guesses in "
                             "one evaluation; use an hf: or gguf: drafter")
        self.cheap, self.model = cheap, model
        self.name = f"hier:{cheap.name}>{model.name}"
        self.tokenizer_fingerprint = model.tokenizer_fingerprint
        self.checks = 0          # batched evaluations of the model drafter
        self.checked = 0         # cheap guesses it checked

    @property
    def capabilities(self) -> Capabilities:
        return passed_on(self.cheap, self.FORWARDS)

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None) -> Proposal:
        if not sampling.greedy:
            return self.model.propose(context, draft_len, sampling, generator)
        base = list(context)
        draft: list[int] = []
        while len(draft) < draft_len:
            guesses = self.cheap.propose(base + draft, draft_len - len(draft), GREEDY).token_ids
            own = self.model.greedy_after(base + draft, guesses)
            agreed = common_prefix(guesses, own)
            draft += guesses[:agreed] + [own[agreed]]
            self.checks += 1
            self.checked += len(guesses)
        return Proposal(draft[:draft_len])

    def rollback(self, length: int) -> None:
        self.cheap.rollback(length)
        self.model.rollback(length)

    def observe(self, context: Sequence[int]) -> None:
        """The cheap drafter's observe() (capabilities.observes)."""
        self.cheap.observe(context)
