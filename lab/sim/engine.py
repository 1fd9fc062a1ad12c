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

A server drafting for itself (SelfDraft: the centralized-spec mode) has its SAT slots answered
the same way, each guess right with the head's acceptance; a step is then the target's verify of
the rows' tokens plus the head's passes.

    engine = ScriptedEngine(profile, pool, {tuple(prompt): output, ...})
    logits = engine.forward(rows)      # StepLogits whose argmax is the scripts' tokens
    engine.seconds                     # how long that step takes on the profile's GPU
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from verify_server.engines.base import StepLogits, logit_spans
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.step_costs import StepProfile, default_kind, row_kind


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


# An EAGLE-class draft head is one decoder layer (with the target's features as its input) and a
# reduced-vocabulary LM head: about 1/32 of an 8B target's layers plus ~0.1B of head weights, so
# a head pass reads a few percent of the target's bytes; with its own kernel launches and the
# feature gather, 0.1 of a one-token decode step of the same rows is a generous round figure
# (a separate draft model is ~37.5% of an 8B target's forward, SpecDecode-Bench).
HEAD_COST = 0.1
# The per-token acceptance of the head's guesses. EAGLE-3 with K=2 runs 1.65x faster than plain
# decoding at batch 1 on an H100 (vLLM). That speedup is after the head's 2 x HEAD_COST passes
# and the wider verify (~1.01x at batch 1), so a pass must emit about 1.65 x 1.2 = 1.98 tokens:
# (1 - a^3) / (1 - a) = 1 + a + a^2 = 1.98 gives a = 0.62 (a pass emits 2.00 tokens). Taken as
# tokens per pass alone (1 + a + a^2 = 1.65) it would be a = 0.45, which undersells the head.
ACCEPTANCE = 0.62
DRAFTS = 2           # K: the head's guesses per pass (EAGLE-3's K=2 above)


@dataclass(frozen=True, slots=True)
class SelfDraft:
    """The server drafting for itself with an EAGLE-class head, simulated: each of the `slots`
    guesses of a pass is the script's next token with chance `acceptance` (independently per
    position, drawn from `seed`), else a wrong one; each pass that drafts costs `slots` head
    passes of `head_cost` of a one-token decode step of its drafting rows."""
    acceptance: float = ACCEPTANCE
    head_cost: float = HEAD_COST
    slots: int = DRAFTS
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"a draft head's acceptance is within 0..1, not {self.acceptance}")
        if self.head_cost < 0 or self.slots < 1:
            raise ValueError("a draft head costs >= 0 and drafts at least one token a pass")

    def tokens_per_pass(self) -> float:
        """Expected tokens a pass emits: (1 - a^(K+1)) / (1 - a)."""
        a, k = self.acceptance, self.slots
        return float(k + 1) if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)


class ScriptMissing(LookupError):
    """A session opened with a prompt the simulation has no script for."""


def bookkeeping_pool(tokens: int, block_tokens: int, windows: tuple[int | None, ...] = (),
                     row_tokens: int | None = None) -> BlockPool:
    """A pool of the memory `tokens` of every layer's KV take (rounded up to whole blocks) that
    holds no keys or values: the server's admission and block accounting without the memory.
    With `windows` (each layer's sliding window, verify_server.shapes.windows) its windowed
    layers keep only their window, as a server's pool of those bytes does (rows of up to
    `row_tokens` entries): the same memory is then more slots, each one group's layers'."""
    shape = KVShape(len(windows), 1, 0, torch.bfloat16, windows=windows)
    slots = tokens * max(shape.layers, 1) // max(shape.group_layers, 1)
    blocks = -(-slots // block_tokens) + 1       # and the zero block no session gets
    return BlockPool(shape, blocks, block_tokens, row_tokens=row_tokens)


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
    # chains only (the scripts say nothing of a tree's other branches), but for its own SAT
    # blocks when it drafts for itself: only the block after the accepted tokens is ever read
    branches = False

    def __init__(self, profile: StepProfile, pool: BlockPool,
                 scripts: Mapping[tuple[int, ...], Sequence[int]], host: HostCost = HostCost(),
                 filler: int = 0, drafts: SelfDraft | None = None, vocab_size: int = 0) -> None:
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
        # drafting for itself: SAT slots carry the head's guesses, a block after every place a
        # draft may be cut (the head drafts again after whatever was accepted)
        self.drafts, self.vocab_size = drafts, vocab_size
        self.branches = drafts is not None
        self._guesses = random.Random(f"self-draft-{drafts.seed}") if drafts else None
        self.sat_rows = 0         # rows that carried SAT slots (drafting passes of a session)
        self.plain_rows = 0       # rows of a server mode's session without them

    def new_kv(self) -> ScriptedKV:
        return ScriptedKV(self.pool, self.scripts)

    def activate(self) -> None:
        """One engine per simulated server: nothing to route."""

    def forward(self, rows: Sequence[Row]) -> StepLogits:
        gpu = self.step_gpu_seconds(rows)
        self.gpu_seconds += gpu
        self.seconds = gpu + self.host.seconds(len(rows))
        targets: list[int] = []
        for row in rows:
            kv = row.kv
            kv.slots(kv.length, kv.length + row.width)      # the blocks a real step writes
            if row.want_logits:
                targets += self._targets(kv, len(row.tokens)) + self._guessed(kv, row)
            self._count(row)
        _, spans = logit_spans(rows)
        return StepLogits(torch.empty(0), spans, torch.tensor(targets or [self.filler]))

    def step_gpu_seconds(self, rows: Sequence[Row]) -> float:
        """The profile's time for the rows; drafting for itself, a row is the target's verify of
        its tokens (the head's guesses are no positions of the target's) and the step adds the
        head's passes over the rows that draft."""
        if self.drafts is None:
            return self.profile.step_seconds([(r.kv.length, r.width, row_kind(r)) for r in rows])
        target = self.profile.step_seconds([(r.kv.length, len(r.tokens), row_kind(r) if
                                             not r.sat_slots else default_kind(len(r.tokens)))
                                            for r in rows])
        drafting = [(r.kv.length, 1, "decode") for r in rows if r.sat_slots]
        if not drafting:
            return target
        passes = max(r.sat_slots for r in rows)
        return target + passes * self.drafts.head_cost * self.profile.step_seconds(drafting)

    def _count(self, row: Row) -> None:
        if row.sat_slots:
            self.sat_rows += 1
        elif row.want_logits and len(row.tokens) == 1:
            self.plain_rows += 1

    def _guessed(self, kv: ScriptedKV, row: Row) -> list[int]:
        """The row's SAT slots: block b follows the row's first a = anchors[b] tokens, so its
        slot j guesses the script's token at emitted + a + j, right with the head's acceptance."""
        if not row.sat_slots or not row.want_logits:
            return []
        emitted = kv.length - kv.prompt_tokens
        guesses = []
        for anchor in row.blocks:
            for truth in self._targets_at(kv, emitted + anchor, row.sat_slots):
                guesses.append(truth if self._right() else (truth + 1) % max(self.vocab_size, 2))
        return guesses

    def _right(self) -> bool:
        return self.drafts is not None and self._guesses.random() < self.drafts.acceptance

    def _targets_at(self, kv: ScriptedKV, start: int, count: int) -> list[int]:
        wanted = kv.script[start:start + count]
        return list(wanted) + [self.filler] * (count - len(wanted))

    def _targets(self, kv: ScriptedKV, width: int) -> list[int]:
        """The target's token after each of the row's positions. Position j follows the row's
        first j draft tokens; past the first one that left the script its token is never read
        (acceptance stops there), so every position reads the script as if the draft held."""
        emitted = kv.length - kv.prompt_tokens         # output tokens the KV already holds
        return self._targets_at(kv, emitted, width)
