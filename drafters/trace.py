"""A recorded drafter and its replay: what a real drafter proposed at every position of the
target's greedy output, so many emulated devices can draft without running a model.

Under greedy decoding a device's context is always prompt + a prefix of the target's output, so
one proposal per position is everything the drafter could ever be asked for. Example: target
output [5, 6, 7], max_k 2 -> proposals[0] drafts after the prompt, proposals[2] after
prompt + [5, 6]; replaying at context prompt + [5] returns proposals[1][:k].

File format (JSONL): a header line {"sled_traces": 1, "target", "drafter", "max_k",
"tokenizer_fingerprint"}, then one trace per line {"prompt_ids", "target_ids", "proposals",
"draft_ms_per_token"}.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafters.base import Proposal
from sled.sampling import Sampling

FORMAT_VERSION = 1


@dataclass(slots=True)
class Trace:
    prompt_ids: list[int]
    target_ids: list[int]                 # the target's greedy output for the prompt
    proposals: list[list[int]]            # [len(target_ids)] of [<= max_k]: drafts after each prefix
    draft_ms_per_token: float = 0.0       # measured while recording, on the recording machine
    drafter: str = ""
    tokenizer_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if len(self.proposals) != len(self.target_ids):
            raise ValueError(f"a trace needs one proposal per target token: {len(self.proposals)} "
                             f"proposals for {len(self.target_ids)} tokens")


@dataclass(slots=True)
class TraceSet:
    """Traces recorded with one drafter against one target."""
    target: str
    drafter: str
    max_k: int
    traces: list[Trace] = field(default_factory=list)
    tokenizer_fingerprint: str | None = None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"sled_traces": FORMAT_VERSION, "target": self.target, "drafter": self.drafter,
                  "max_k": self.max_k, "tokenizer_fingerprint": self.tokenizer_fingerprint}
        lines = [json.dumps(header)]
        lines += [json.dumps({"prompt_ids": t.prompt_ids, "target_ids": t.target_ids,
                              "proposals": t.proposals, "draft_ms_per_token": t.draft_ms_per_token})
                  for t in self.traces]
        path.write_text("\n".join(lines) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TraceSet":
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        header = json.loads(lines[0]) if lines else {}
        if header.get("sled_traces") != FORMAT_VERSION:
            raise ValueError(f"{path} is not a sled trace file (version {FORMAT_VERSION} header expected)")
        fingerprint = header.get("tokenizer_fingerprint")
        traces = [Trace(prompt_ids=row["prompt_ids"], target_ids=row["target_ids"],
                        proposals=row["proposals"], draft_ms_per_token=row.get("draft_ms_per_token", 0.0),
                        drafter=header["drafter"], tokenizer_fingerprint=fingerprint)
                  for row in map(json.loads, lines[1:])]
        return cls(target=header["target"], drafter=header["drafter"], max_k=header["max_k"],
                   traces=traces, tokenizer_fingerprint=fingerprint)


def record_traces(drafter, prompts_ids: Sequence[Sequence[int]],
                  target_outputs: Sequence[Sequence[int]], max_k: int, progress=None) -> list[Trace]:
    """Drive a real drafter greedily along each target output, one proposal per position.

    The context grows by one target token per position; rolling the drafter back to the context
    after each proposal keeps the KV of the context, so each position costs one fed token plus
    max_k - 1 drafted ones, not a prefill. `progress` is an optional rich Progress.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    greedy = Sampling()
    task = progress.add_task(f"recording {drafter.name}", total=sum(map(len, target_outputs))) \
        if progress is not None else None
    traces = []
    for prompt, target in zip(prompts_ids, target_outputs, strict=True):
        context = list(prompt)
        drafter.rollback(0)
        proposals: list[list[int]] = []
        seconds = 0.0
        for token in target:
            started = time.perf_counter()
            proposals.append(list(drafter.propose(context, max_k, greedy).token_ids))
            seconds += time.perf_counter() - started
            drafter.rollback(len(context))
            context.append(token)
            if task is not None:
                progress.advance(task)
        drafted = sum(map(len, proposals))
        traces.append(Trace(list(prompt), list(target), proposals,
                            seconds * 1e3 / drafted if drafted else 0.0, drafter.name,
                            drafter.tokenizer_fingerprint))
    return traces


class TraceDivergence(RuntimeError):
    """A replayed context left the recorded greedy path (a sampling session, or a lossy server)."""


class TraceDrafter:
    """Replays a Trace behind the Drafter protocol; deterministic (q = one-hot).

    `device_profile` (anything with draft_seconds(k), e.g. edge_client.profiles.DeviceProfile)
    sets the latency apropose() emulates; without one it is the recorded draft_ms_per_token * k.
    """

    def __init__(self, trace: Trace, device_profile=None) -> None:
        self.trace = trace
        self.device_profile = device_profile
        self.name = f"trace:{trace.drafter}" if trace.drafter else "trace"
        self.tokenizer_fingerprint = trace.tokenizer_fingerprint

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        if not sampling.greedy:
            raise ValueError("a trace replays greedy drafts only: use temperature 0")
        position = self._position(context)
        proposals, target = self.trace.proposals, self.trace.target_ids
        if position < len(proposals):
            return Proposal(list(proposals[position][:k]))
        # Past the recorded output: the target's own tokens where there are any, else repeat.
        return Proposal(list(target[position:position + k]) or [context[-1]])

    async def apropose(self, context: Sequence[int], k: int, sampling: Sampling,
                       generator: torch.Generator | None = None) -> Proposal:
        """propose() after the emulated drafting time, without a thread."""
        await asyncio.sleep(self.draft_seconds(k))
        return self.propose(context, k, sampling, generator)

    def draft_seconds(self, k: int) -> float:
        if self.device_profile is not None:
            return self.device_profile.draft_seconds(k)
        return k * self.trace.draft_ms_per_token / 1e3

    def rollback(self, length: int) -> None:
        """Stateless: the position comes from the context length."""

    def _position(self, context: Sequence[int]) -> int:
        """How many target tokens the context holds; raises if it left the recorded path."""
        prompt, target = self.trace.prompt_ids, self.trace.target_ids
        position = len(context) - len(prompt)
        recorded = min(position, len(target))
        if position < 0 or list(context[:len(prompt) + recorded]) != prompt + target[:recorded]:
            raise TraceDivergence(
                f"context of {len(context)} tokens is not the trace's prompt ({len(prompt)} tokens) "
                f"followed by the target's greedy output: a trace replays only the greedy path")
        return position
