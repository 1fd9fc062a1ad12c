"""Whether a session starts its next draft with the server's SAT hints: only while they beat the
session's own drafter.

A verdict carries hints (lookahead) when the whole draft was accepted. Used, they replace the
drafter's first tokens of the next draft. Whether they are better is measured on the session's
own rounds, and the measurement costs nothing: when hints arrive and the drafter drafts anyway,
the next verdict tells what the target emitted, so the hints' run (how many of them lead the
emitted tokens) can be scored beside the drafter's run over the same positions:

    hints      a b X            drafter  a b c d      emitted (verdict)  a b c + correction
    hint run   2                drafter run over the first 3 positions:  3

Both averages are decayed (the newest round weighs `smoothing`). Hints are used once they have
been scored `min_rounds` times and their mean run beats the drafter's; while they are used their
real runs keep being measured, and they are dropped as soon as their mean falls below the
drafter's last measured mean. While hints are not used the session asks for them only every
`probe_every`-th round, so a target's SAT slots are not spent on hints nobody takes.
`always=True` uses every hint, whatever it scores (to measure raw hints).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

HINT_USES = ("measured", "always")   # RoundSettings.hints


def leading_matches(hints: Sequence[int], emitted: Sequence[int]) -> int:
    """How many of the hints lead the emitted tokens."""
    run = 0
    for hint, token in zip(hints, emitted):
        if hint != token:
            break
        run += 1
    return run


@dataclass(slots=True)
class HintPolicy:
    lookahead: int                  # hints asked per verdict when asking (0: never)
    always: bool = False            # use every hint, unmeasured
    min_rounds: int = 3             # scored rounds before hints may be used
    probe_every: int = 4            # while hints are not used, ask on every n-th round
    smoothing: float = 0.3
    hint_run: float = 0.0           # decayed mean run of the hints (scored or real)
    drafter_run: float = 0.0        # decayed mean run of the drafter over the same positions
    scored: int = 0
    using: bool = False
    _rounds: int = field(default=0, init=False)
    _shadow: tuple[int, ...] = field(default=(), init=False)   # hints received, not used

    def __post_init__(self) -> None:
        self.using = self.using or self.always

    def ask(self) -> int:
        """Hints to ask for with this round's draft."""
        if self.lookahead == 0:
            return 0
        self._rounds += 1
        return self.lookahead if self.using or self._rounds % self.probe_every == 1 else 0

    def take(self, hints: Sequence[int], draft_len: int) -> bool:
        """The verdict brought hints: whether the next draft (of draft_len) starts with them.
        Those not used are kept, as many as a draft would have used, to be scored against the
        next verdict."""
        self._shadow = () if self.using else tuple(hints[:draft_len])
        return self.using and bool(hints)

    def observe(self, hinted: int, accepted: int, emitted: Sequence[int]) -> None:
        """A verdict on a draft that began with `hinted` hint tokens (0: the drafter's own), with
        `accepted` draft tokens accepted and `emitted` the tokens it committed."""
        w = self.smoothing
        if hinted:
            self.hint_run += w * (min(accepted, hinted) - self.hint_run)
            if self.hint_run < self.drafter_run and not self.always:
                self.using = False
            return
        shadow, self._shadow = self._shadow, ()
        if not shadow:
            return
        positions = len(shadow)
        self.hint_run += w * (leading_matches(shadow, emitted) - self.hint_run)
        self.drafter_run += w * (min(accepted, positions) - self.drafter_run)
        self.scored += 1
        if self.scored >= self.min_rounds and self.hint_run > self.drafter_run:
            self.using = True
