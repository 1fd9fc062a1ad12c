"""EmulatedEngine: an engine whose every step is held to a step-cost profile's time, so the
server on this machine paces itself like the GPU the profile was measured on
(`sled serve --emulate PROFILE`).

The target still computes every token, so every output is still the target's own; only the
wall time of a step changes. A step whose real compute already took longer than the profile's
time cannot be slowed down to it: it is an overrun, counted, and past 1% of steps the emulation
no longer stands for that GPU (a cheaper target, or fewer devices, brings it back).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from verify_server.engines.base import Engine, StepLogits
from verify_server.engines.rows import Row
from verify_server.metrics import Metrics
from verify_server.step_costs import StepProfile, row_kind

log = logging.getLogger("sled.server")


class EmulatedEngine:
    """`engine` (every other attribute is its own), each forward held to the profile's time."""

    def __init__(self, engine: Engine, profile: StepProfile, metrics: Metrics) -> None:
        self.engine, self.profile, self.metrics = engine, profile, metrics
        self.measured_rows = max(cell.rows for cell in profile.cells)
        self._said_beyond = False

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    launches_ahead = False     # every step is held to its time before it returns

    def forward(self, rows: Sequence[Row]) -> StepLogits:
        due = self.due(rows, time.perf_counter())
        logits = self.engine.forward(rows)
        self.hold(due)
        return logits

    def launch(self, rows: Sequence[Row], send_argmax: bool = False) -> StepLogits:
        due = self.due(rows, time.perf_counter())
        logits = self.engine.launch(rows, send_argmax)
        self.hold(due)
        return logits

    def due(self, rows: Sequence[Row], started: float) -> float:
        """When a step of these rows, started at `started` (perf_counter), ends on the profile's
        device (read before the step: its rows' lengths change once it is done)."""
        if len(rows) > self.measured_rows and not self._said_beyond:
            self._said_beyond = True
            log.warning("a step of %d sessions is past the %d the profile %s measured: its time, "
                        "and every such step's, comes from the rule fitted through the cells",
                        len(rows), self.measured_rows, self.profile.name)
        return started + self.profile.step_seconds([(row.kv.length, row.width, row_kind(row))
                                                    for row in rows])

    def hold(self, due: float) -> None:
        """Engine thread, after the step: wait until it is due, or count an overrun."""
        self.metrics.emulated_steps.inc()
        late = time.perf_counter() - due
        if late > 0:
            self.metrics.emulated_overruns.inc()
            self.metrics.emulated_overrun_seconds.inc(late)
        else:
            time.sleep(-late)
