"""What a device says about itself: its state and why (DeviceState), its Prometheus metrics
(DeviceMetrics) and its recent rounds for telemetry (Window). edge_client.daemon.Device
composes them into its status."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from edge_client.result import RoundStat

log = logging.getLogger("sled.device")


class DeviceState:
    """starting, waiting, ready or degraded (its server went silent, has answered nothing since
    and no other answers), and why; `listeners` are told on each change (and whenever the
    device's settings change: tell())."""

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self.state, self.reason = "starting", ""
        self.listeners: list[Callable[[], None]] = []

    def set(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.reason):
            log.info("device %s: %s (%s)", self.device_id, state, reason)
            self.state, self.reason = state, reason
            self.tell()

    def tell(self) -> None:
        for listener in list(self.listeners):
            listener()


class DeviceMetrics:
    """Prometheus metrics of one device (its own registry)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sled_device_requests", "Local requests by outcome", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("sled_device_prompt_tokens", "Prompt tokens received", registry=r)
        self.tokens = Counter("sled_device_generated_tokens", "Tokens generated", ["lossless"],
                              registry=r)
        self.rounds = Counter("sled_device_rounds", "Verify rounds", registry=r)
        self.draft_tokens = Counter("sled_device_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("sled_device_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.resumes = Counter("sled_device_resumes", "Sessions reopened after a lost server",
                               registry=r)
        self.active = Gauge("sled_device_active_sessions", "Requests being generated", registry=r)
        # where the server placed this device's sessions (Verdict.placement): tokens by where
        # they came from, and the moves
        self.placed_tokens = Counter("sled_device_placed_tokens", "Tokens by where they came "
                                     "from: device (its drafts), server or server_sat",
                                     ["placement"], registry=r)
        self.moves = Counter("sled_device_placement_moves", "Times the server moved one of this "
                             "device's sessions between its drafting and its own", registry=r)
        self.round_trip = Histogram("sled_device_round_trip_seconds", "Draft sent -> verdict",
                                    registry=r)
        self.draft_seconds = Histogram("sled_device_draft_seconds", "Drafting time per round",
                                       registry=r)
        # an emulated board (emulation.device): its paced drafts, and those this machine made late
        self.paced_drafts = Counter("sled_device_paced_drafts", "Drafts paced to the emulated "
                                    "board's speed", registry=r)
        self.late_drafts = Counter("sled_device_late_drafts", "Paced drafts that came more than "
                                   "10% past the board's time (the host could not keep its pace)",
                                   registry=r)
        # per draft position (1..k): how often a draft reached it, and how often it was accepted
        self.position_drafted = Counter("sled_device_position_drafted", "Draft tokens verified at "
                                        "each draft position", ["position"], registry=r)
        self.position_accepted = Counter("sled_device_position_accepted", "Draft tokens accepted "
                                         "at each draft position", ["position"], registry=r)

    def count_round(self, stat: RoundStat) -> None:
        """One round of any session."""
        self.rounds.inc()
        self.draft_tokens.inc(stat.verified)
        self.accepted_tokens.inc(stat.accepted)
        for position in range(1, stat.verified + 1):      # positions 1..verified were drafted,
            self.position_drafted.labels(str(position)).inc()
        for position in range(1, stat.accepted + 1):      # 1..accepted accepted
            self.position_accepted.labels(str(position)).inc()
        self.round_trip.observe(stat.round_trip_ms / 1e3)
        self.draft_seconds.observe(stat.draft_ms / 1e3)

    def count_placements(self, placements: dict[str, int], moves: int) -> None:
        """A finished session's tokens by placement, and its moves (GenerationResult)."""
        for placement, tokens in placements.items():
            self.placed_tokens.labels(placement).inc(tokens)
        self.moves.inc(moves)

    def count_paced(self, late: bool) -> None:
        """One draft paced to the emulated board's speed; late: this machine made it late."""
        self.paced_drafts.inc()
        if late:
            self.late_drafts.inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        found = self.registry.get_sample_value(name, labels or {})
        return 0.0 if found is None else found


class Window:
    """Recent rounds, for telemetry: tokens/s, acceptance and RTT over the last `seconds`."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.rounds: deque[tuple[float, RoundStat]] = deque()
        self.tokens: deque[tuple[float, int]] = deque()

    def round(self, stat: RoundStat) -> None:
        self.rounds.append((time.monotonic(), stat))

    def emitted(self, n: int) -> None:
        self.tokens.append((time.monotonic(), n))

    def summary(self) -> dict:
        cut = time.monotonic() - self.seconds
        for q in (self.rounds, self.tokens):
            while q and q[0][0] < cut:
                q.popleft()
        stats = [s for _, s in self.rounds]
        verified = sum(s.verified for s in stats)
        return {
            "tokens_per_s": round(sum(n for _, n in self.tokens) / self.seconds, 3),
            "acceptance": round(sum(s.accepted for s in stats) / verified, 4) if verified else None,
            "rtt_ms": round(sum(s.round_trip_ms for s in stats) / len(stats), 2) if stats else None,
        }
