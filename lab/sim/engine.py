"""The engine of a simulated server: the step-cost profile's time, and the target's tokens from
a script.

A simulated fleet has no target to run. Each session's output is known in advance (its
script: the greedy output the devices' traces were drawn along), so a step's argmax is read from
the scripts instead of computed: at a row's position j the target's token is the script's next
one after the context the row has seen. Acceptance is then decided by the server's own rule
(acceptance.decide) against it, and a step lasts what the profile says a step of these rows
lasts on its GPU, plus the host's own time for it when one is given (HostCost): `seconds`, read
by the simulated scheduler.

The KV pool is a real BlockPool with no storage behind it: admission, reservations, blocks and
the prefix cache are the server's own, at the size of the profiled GPU's memory.

    engine = ScriptedEngine(profile, pool, {tuple(prompt): output, ...})
    logits = engine.forward(rows)      # StepLogits whose argmax is the scripts' tokens
    engine.seconds                     # how long that step takes on the profile's GPU
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from verify_server.engines.base import StepLogits, logit_spans
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.step_costs import StepProfile, row_kind


@dataclass(frozen=True, slots=True)
class HostCost:
    """The server host's own time per step, outside the GPU's: Python planning, deciding and
    answering every row, which sled's scheduler does not overlap with the next forward. A
    step-cost profile times the GPU alone; zero here is a host that keeps up (as the best
    serving engines overlap it)."""
    step_ms: float = 0.0
    row_ms: float = 0.0

    def seconds(self, rows: int) -> float:
        return (self.step_ms + self.row_ms * rows) / 1e3

    def __str__(self) -> str:
        if not (self.step_ms or self.row_ms):
            return "none (the profile's GPU time only)"
        return f"{self.step_ms:.2f} ms a step + {self.row_ms:.3f} ms a session in it"


class ScriptMissing(LookupError):
    """A session opened with a prompt the simulation has no script for."""


def bookkeeping_pool(tokens: int, block_tokens: int) -> BlockPool:
    """A pool of `tokens` (rounded up to whole blocks) that holds no keys or values: the
    server's admission and block accounting without the memory."""
    blocks = -(-tokens // block_tokens) + 1       # and the zero block no session gets
    return BlockPool(KVShape(0, 1, 1, torch.bfloat16), blocks, block_tokens)


class ScriptedKV(SessionKV):
    """A session's KV that knows the session's script (found by its prompt when admitted)."""

    __slots__ = ("script", "prompt_tokens", "_scripts")

    def __init__(self, pool: BlockPool, scripts: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        super().__init__(pool)
        self._scripts = scripts

    def admit(self, prefill: Sequence[int], max_tokens: int, tenant: bytes) -> int:
        key = tuple(prefill)
        if key not in self._scripts:
            raise ScriptMissing(f"no script for a prompt of {len(prefill) + 1} tokens: the "
                                "simulation serves only the prompts of its workload")
        self.script, self.prompt_tokens = self._scripts[key], len(prefill)
        return super().admit(prefill, max_tokens, tenant)


class ScriptedEngine:
    """The engine protocol (verify_server.engines.base.Engine) over a bookkeeping pool: every
    forward takes its rows' KV slots as a real engine does and returns the scripts' argmax."""

    kind = "simulated"
    branches = False          # chains only: the scripts say nothing of a tree's other branches

    def __init__(self, profile: StepProfile, pool: BlockPool,
                 scripts: Mapping[tuple[int, ...], Sequence[int]], host: HostCost = HostCost(),
                 filler: int = 0) -> None:
        self.profile = profile
        self.host = host
        self.pool = pool
        # keyed by prompt[:-1] (what a session's prefill holds), as ScriptedKV.admit looks it up
        self.scripts = scripts
        self.filler = filler      # the token past a script's end (a session never reads it)
        self.seconds = 0.0        # the last step's time: the profile's GPU time and the host's
        self.gpu_seconds = 0.0    # every step's GPU time so far
        self.sat = None
        self.bytes_copied = 0

    def new_kv(self) -> ScriptedKV:
        return ScriptedKV(self.pool, self.scripts)

    def activate(self) -> None:
        """One engine per simulated server: nothing to route."""

    def forward(self, rows: Sequence[Row]) -> StepLogits:
        gpu = self.profile.step_seconds([(row.kv.length, row.width, row_kind(row)) for row in rows])
        self.gpu_seconds += gpu
        self.seconds = gpu + self.host.seconds(len(rows))
        targets: list[int] = []
        for row in rows:
            kv = row.kv
            kv.slots(kv.length, kv.length + row.width)      # the blocks a real step writes
            if row.want_logits:
                targets += self._targets(kv, row.width)
        _, spans = logit_spans(rows)
        return StepLogits(torch.empty(0), spans, torch.tensor(targets or [self.filler]))

    def _targets(self, kv: ScriptedKV, width: int) -> list[int]:
        """The target's token after each of the row's positions. Position j follows the row's
        first j draft tokens; past the first one that left the script its token is never read
        (acceptance stops there), so every position reads the script as if the draft held."""
        emitted = kv.length - kv.prompt_tokens         # output tokens the KV already holds
        wanted = kv.script[emitted:emitted + width]
        return list(wanted) + [self.filler] * (width - len(wanted))
