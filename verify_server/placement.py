"""Where each session's next tokens come from: the device's drafts, the target's own SAT slots, or
a plain decode step (`sled serve --placement latency|gpu|fixed`). The server is the one place
that knows its load, so it moves a session between them as the load changes; the protocol
carries the move (Open.movable, Verdict.placement) and the output stays the target's.

The policy is asked at each of a movable session's round boundaries, from plain values: the
GPU's recent load (`StepLoad`: the share of its time in steps past what its lightest step
takes), and the session's own placement, acceptance and pace.

    fixed    nobody moves (a session keeps the mode it opened with)
    latency  the fastest tokens for each device: while the GPU's load is under low, every
             movable session is served by the server (its SAT slots where the
             target has them, else plain decoding), at the GPU's rate. Past high, sessions go
             back to drafting on their devices, those whose drafts the target accepts most
             first: one goes back when its acceptance is at least (1 - load) / (1 - high), so
             the more loaded the GPU the more go back, and at a full GPU all of them
    gpu      the least GPU time per token that keeps each device at its SLO: a session drafts
             on its device, and moves to the server only while its device's own rate is under
             the SLO and the GPU is busy less than high; back to its device past high

low and high are LOW and HIGH unless the operator sets them (--placement-low, --placement-high).

Under every preference a session moves again at most SETTLE_S seconds after a move (its first
move may come at its first round boundary), and a device whose
own drafting was measured slower than the SLO is never moved back to drafting (the server keeps
it while it can; past high it stays too: moving it back would miss its SLO for sure).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sled.v1 import verifier_pb2 as pb

PREFERENCES = ("fixed", "latency", "gpu")
LOW, HIGH = 0.5, 0.8          # the GPU's load under which it serves, past which it hands back
SETTLE_S = 2.0                # a session moves at most once in this many seconds
DEVICE = pb.GENERATION_MODE_DEVICE_DRAFTS


class StepLoad:
    """How loaded the GPU has been lately: the share of the recent past it spent in steps
    beyond what its lightest step takes, exponentially weighted over `window` seconds
    (sled.clock times, each step from its start to its end).

    A GPU decoding one session back to back is in steps all the time, yet has room for many
    more rows in each: only the time a step takes past the lightest one counts. So one session
    decoded back to back loads it about 0; steps three times the lightest, back to back, load
    it 2/3; idle time loads it nothing. The lightest step is the lightest the server has run
    (a step of one short row: what the GPU's weights cost to read), so a load that stays high
    stays counted.

        lightest step 7 ms; steps of 21 ms back to back -> load about 0.67
    """

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self.value = 0.0
        self.at: float | None = None
        self.lightest = math.inf

    def step(self, started: float, ended: float) -> None:
        duration = max(ended - started, 0.0)
        self.lightest = min(self.lightest, duration)
        self._advance(started, 0.0)
        self._advance(ended, 1.0 - self.lightest / duration if duration > 0 else 0.0)

    def share(self, now: float) -> float:
        """The load as of `now` (idle since the last step)."""
        if self.at is None:
            return 0.0
        return self.value * math.exp(-max(now - self.at, 0.0) / self.window)

    def _advance(self, t: float, loaded: float) -> None:
        if self.at is None:
            self.at = t
            return
        kept = math.exp(-max(t - self.at, 0.0) / self.window)
        self.value = self.value * kept + (1.0 - kept) * loaded
        self.at = max(self.at, t)


@dataclass(frozen=True, slots=True)
class Standing:
    """What the policy knows of one session at its round boundary."""
    placement: int               # where its tokens come from now (a GenerationMode)
    acceptance: float            # the share of its device's drafts the target keeps (0..1)
    device_rate: float | None    # tokens/s it got while its device drafted (None: not measured)
    since_move: float            # seconds since it last moved (inf: it never did)


class PlacementPolicy:
    """`preference`: one of PREFERENCES; `slo_rate`: the tokens/s a device should get;
    `server_mode`: the server's own placement (GENERATION_MODE_SERVER_SAT where the target has
    SATs, else GENERATION_MODE_SERVER); `low` and `high`: the loads under which the server
    serves and past which it hands back."""

    def __init__(self, preference: str, slo_rate: float, server_mode: int,
                 low: float = LOW, high: float = HIGH) -> None:
        if preference not in PREFERENCES:
            raise ValueError(f"unknown placement {preference!r}: use {' or '.join(PREFERENCES)}")
        if not 0 < low < high < 1:
            raise ValueError(f"placement loads must be 0 < low < high < 1 (got {low}, {high})")
        self.preference, self.slo_rate, self.server_mode = preference, slo_rate, server_mode
        self.low, self.high = low, high

    @property
    def moves(self) -> bool:
        return self.preference != "fixed"

    def place(self, session: Standing, busy: float) -> int:
        """Where the session's next tokens come from, the GPU's load `busy` (StepLoad)."""
        if not self.moves or session.since_move < SETTLE_S:
            return session.placement
        drafting = session.placement == DEVICE
        slow = session.device_rate is not None and session.device_rate < self.slo_rate
        if self.preference == "latency":
            wanted = self._for_latency(drafting, session.acceptance, busy)
        else:
            wanted = self._for_gpu(slow, busy)
        if wanted == DEVICE and not drafting and slow:
            return session.placement        # a slow drafter is never moved back to drafting
        return wanted

    def _for_latency(self, drafting: bool, acceptance: float, busy: float) -> int:
        if busy < self.low:
            return self.server_mode
        if busy > self.high and acceptance >= (1.0 - busy) / (1.0 - self.high):
            return DEVICE
        return DEVICE if drafting else self.server_mode

    def _for_gpu(self, slow: bool, busy: float) -> int:
        if busy > self.high:
            return DEVICE
        return self.server_mode if slow else DEVICE
