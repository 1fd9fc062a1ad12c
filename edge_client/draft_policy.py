"""How many tokens a device drafts next round: the draft_len that maximises expected tokens per
second.

With per-token acceptance a, a draft of k tokens yields on average E(k) = (1 - a^(k+1)) / (1 - a)
tokens (the accepted prefix plus the target's one), and a round costs about k * t_draft + t_round(k)
(drafting, then the round trip including the server's forward, which grows with the tokens it
verifies). The policy keeps moving averages of a, t_draft and t_round (overall, and per draft
length once it has seen that length) from the device's own rounds and picks k in
[1, max_draft_len], never above the server's suggested length (its view of its own load). One
policy may serve a device's sessions one after another, so what it learned carries over.

a is estimated from what the rounds really judged: a round of v draft tokens with A accepted
passed A tokens and, if A < v, failed one; the tokens after a rejection were never judged. So
a = passed / (passed + failed) over decayed counts (the maximum-likelihood per-token rate of a
run that stops at the first failure), not A / v, which counts every unjudged token as a failure.

    a = 0.9, t_draft = 2 ms,  t_round = 60 ms  -> long drafts pay: k = 16 (max_draft_len)
    a = 0.6, t_draft = 20 ms, t_round = 5 ms   -> drafting dominates: k = 1
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_TOKENS = 2.0   # how many judged tokens the prior acceptance weighs


def expected_tokens(acceptance: float, draft_len: int) -> float:
    """Mean tokens a round yields: accepted draft tokens plus the target's correction/bonus."""
    if acceptance >= 1.0:
        return draft_len + 1.0
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class DraftPolicy:
    max_draft_len: int = 16
    acceptance: float = 0.7          # per-token acceptance: prior, then estimated (module doc)
    draft_ms: float = 10.0           # per drafted token
    round_ms: float = 20.0           # send -> verdict, server time included
    smoothing: float = 0.3           # weight of the newest round in each average
    _passed: float = field(default=0.0, init=False)      # decayed count of accepted draft tokens
    _judged: float = field(default=0.0, init=False)      # ... of accepted + rejected ones
    _round_by_len: dict[int, float] = field(default_factory=dict, init=False)  # verified -> round ms

    def __post_init__(self) -> None:
        if self.max_draft_len < 1 or not 0.0 < self.smoothing <= 1.0:
            raise ValueError("max_draft_len must be >= 1 and smoothing in (0, 1]")
        self._passed, self._judged = self.acceptance * PRIOR_TOKENS, PRIOR_TOKENS

    def observe(self, verified: int, accepted: int, draft_ms: float, round_ms: float) -> None:
        """Learn from one finished round (draft_ms is the whole draft's time)."""
        w = self.smoothing
        if verified:
            failed = 1.0 if accepted < verified else 0.0
            self._passed = (1 - w) * self._passed + accepted
            self._judged = (1 - w) * self._judged + accepted + failed
            # A draft always accepted whole says little about the token after it: stay below 1.
            self.acceptance = min(self._passed / self._judged, 0.99)
            self.draft_ms += w * (draft_ms / verified - self.draft_ms)
            before = self._round_by_len.get(verified)
            self._round_by_len[verified] = round_ms if before is None else before + w * (round_ms - before)
        self.round_ms += w * (round_ms - self.round_ms)

    def round_cost(self, draft_len: int) -> float:
        """Expected round trip (ms) for a draft of draft_len: what rounds of that length took,
        else what rounds of the nearest length seen took (the shorter on a tie), else the average."""
        if not self._round_by_len:
            return self.round_ms
        nearest = min(self._round_by_len, key=lambda seen: (abs(seen - draft_len), seen))
        return self._round_by_len[nearest]

    def rate(self, draft_len: int) -> float:
        """Expected tokens per millisecond for a draft of draft_len."""
        cost = draft_len * self.draft_ms + self.round_cost(draft_len)
        return expected_tokens(self.acceptance, draft_len) / cost

    def pipelining_pays(self, draft_len: int) -> bool:
        """Whether drafting ahead while the verdict on a draft of k = draft_len tokens is in
        flight is expected to gain more time than it loses.

        It gains when the whole draft is accepted and the bonus is the drafter's guess (about
        a^(k+1)): the next draft then starts with the tokens drafted during the round trip, one
        per draft step after the guess, at most k. Otherwise the device waits out the step in
        flight when the verdict arrives, half a step on average, unless the speculation had
        already stopped at its cap (k + 1 steps, the guess included) before the verdict.

            a = 0.9, t_draft = 20 ms, t_round = 150 ms, k = 4 -> pays (2.4 steps gained)
            a = 0.4, t_draft = 20 ms, t_round = 50 ms,  k = 4 -> does not (0.02 gained, 0.5 lost)
        """
        steps = self.round_cost(draft_len) / self.draft_ms if self.draft_ms > 0 else float("inf")
        keep = self.acceptance ** (draft_len + 1)
        gained = keep * min(draft_len, max(steps - 1.0, 0.0))
        lost = (1.0 - keep) * 0.5 if steps < draft_len + 1 else 0.0
        return gained > lost

    def choose(self, suggested: int = 0) -> int:
        """The best draft_len, capped by the server's suggestion when it gave one."""
        cap = min(self.max_draft_len, suggested) if suggested > 0 else self.max_draft_len
        return max(range(1, cap + 1), key=self.rate)
