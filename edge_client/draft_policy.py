"""How many tokens a device drafts next round: the k that maximises expected tokens per second.

With per-token acceptance a, a draft of k tokens yields on average E(k) = (1 - a^(k+1)) / (1 - a)
tokens (the accepted prefix plus the target's one), and a round costs about k * t_draft + t_round
(drafting, then the round trip including the server's forward). The policy keeps moving averages
of a, t_draft and t_round from the device's own rounds and picks k in [1, max_k], never above the
server's suggested length (its view of its own load).

    a = 0.9, t_draft = 2 ms,  t_round = 60 ms  -> long drafts pay: k = 16 (max)
    a = 0.6, t_draft = 20 ms, t_round = 5 ms   -> drafting dominates: k = 1
"""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens a round yields: accepted draft tokens plus the target's correction/bonus."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class DraftPolicy:
    max_k: int = 16
    acceptance: float = 0.7          # prior, then a moving average of accepted / verified
    draft_ms: float = 10.0           # per drafted token
    round_ms: float = 20.0           # send -> verdict, server time included
    smoothing: float = 0.3           # weight of the newest round in each average

    def __post_init__(self) -> None:
        if self.max_k < 1 or not 0.0 < self.smoothing <= 1.0:
            raise ValueError("max_k must be >= 1 and smoothing in (0, 1]")

    def observe(self, verified: int, accepted: int, draft_ms: float, round_ms: float) -> None:
        """Learn from one finished round (draft_ms is the whole draft's time)."""
        w = self.smoothing
        if verified:
            # A clipped draft that was accepted whole says little about the token after it.
            self.acceptance += w * (min(accepted / verified, 0.99) - self.acceptance)
            self.draft_ms += w * (draft_ms / verified - self.draft_ms)
        self.round_ms += w * (round_ms - self.round_ms)

    def rate(self, k: int) -> float:
        """Expected tokens per millisecond for a draft of k."""
        return expected_tokens(self.acceptance, k) / (k * self.draft_ms + self.round_ms)

    def choose(self, suggested: int = 0) -> int:
        """The best k, capped by the server's suggestion when it gave one."""
        cap = min(self.max_k, suggested) if suggested > 0 else self.max_k
        return max(range(1, cap + 1), key=self.rate)
