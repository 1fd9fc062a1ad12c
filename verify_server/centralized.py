"""Centralized serving, the baseline sled is measured against: the server generates every
device's tokens itself, autoregressively, all sessions batched in each step (the same engine and
KV handling as verification, one new token per session per pass)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from verify_server.engines.base import Engine
from verify_server.engines.rows import Row


@dataclass(slots=True)
class CentralizedRun:
    outputs: list[list[int]]
    forward_passes: int
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def generate_centralized(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         eos_ids: Sequence[int] = ()) -> CentralizedRun:
    """Greedy: output i == generate(prompts[i], do_sample=False) of the same target."""
    started = time.perf_counter()
    caches = [engine.new_kv() for _ in prompts]
    for kv, prompt in zip(caches, prompts):    # one caller's prompts: one tenant
        kv.admit(list(prompt[:-1]), len(prompt) + max_new_tokens, tenant=b"")
    outputs: list[list[int]] = [[] for _ in prompts]
    passes = 0
    prefill = [Row(kv, list(p[:-1]), want_logits=False) for kv, p in zip(caches, prompts) if len(p) > 1]
    if prefill:
        engine.forward(prefill)
        passes += 1
        for row in prefill:
            row.kv.commit(len(row.tokens))
    live = list(range(len(prompts)))
    while live:
        last = [outputs[i][-1] if outputs[i] else prompts[i][-1] for i in live]
        step = engine.forward([Row(caches[i], [t], want_logits=True) for i, t in zip(live, last)])
        passes += 1
        targets = step.targets()           # one argmax, one copy to the host
        for i, span in zip(list(live), step.spans):
            caches[i].commit(1)            # the token fed this pass; the new one goes in next
            token = targets[span.stop - 1]
            outputs[i].append(token)
            if token in eos_ids or len(outputs[i]) >= max_new_tokens:
                live.remove(i)
                caches[i].free()
    return CentralizedRun(outputs, passes, time.perf_counter() - started)
