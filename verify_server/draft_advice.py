"""The draft length the server suggests to a device in every verdict.

Two limits, the smaller wins:
- acceptance: past the point where the whole draft survives with probability < 15 % extra draft
  tokens are mostly wasted (with per-token acceptance a, a draft of k tokens survives with a^k);
- load: every waiting session should fit into one step's token budget, so
  draft_len + 1 <= max_step_tokens / sessions.

    acceptance 0.9, 4 sessions, max_step_tokens 512, max_draft_tokens 16 -> min(18, 127) -> 16
    acceptance 0.5, 256 sessions, max_step_tokens 512                  -> min(3, 1)    -> 1
"""
from __future__ import annotations

import math

SURVIVAL_FLOOR = 0.15


def suggest_draft_len(acceptance: float, sessions: int, max_step_tokens: int,
                      max_draft_tokens: int) -> int:
    if acceptance >= 0.999:
        by_acceptance = max_draft_tokens
    elif acceptance <= 0.0:
        by_acceptance = 1
    else:
        by_acceptance = math.ceil(math.log(SURVIVAL_FLOOR) / math.log(acceptance))
    by_load = max_step_tokens // max(sessions, 1) - 1
    return max(1, min(by_acceptance, by_load, max_draft_tokens))
