"""A recorded drafter and its replay: what a real drafter proposed at every position of the
target's greedy output, so many emulated devices can draft without running a model.

Under greedy decoding a device's context is always prompt + a prefix of the target's output, so
one proposal per position is everything the drafter could ever be asked for. Example: target
output [5, 6, 7], max_k 2 -> proposals[0] drafts after the prompt, proposals[2] after
prompt + [5, 6]; replaying at context prompt + [5] returns proposals[1][:k]. A device drafting
ahead of a verdict (pipelining) also asks after its own drafted tokens: prompt + [5] +
proposals[1][:1] returns proposals[1][1:1 + k], the drafter's own greedy continuation.

File format (JSONL): a header line {"sled_traces": 1, "target", "drafter", "max_k",
"tokenizer_fingerprint"}, then one trace per line {"prompt_ids", "target_ids", "proposals",
"draft_ms_per_token"} and, when the drafter reports them, "confidences" (the drafter's
probability of each proposed token, shaped like "proposals"), which lets a replay stop a draft
early the way the drafter would have. Files without confidences load and replay as before.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafters.base import Proposal, reports_confidence, stop_index
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
    # [len(target_ids)] of [len(proposals[i])]: the drafter's confidence in each proposed token,
    # or None when the drafter reported none
    confidences: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if len(self.proposals) != len(self.target_ids):
            raise ValueError(f"a trace needs one proposal per target token: {len(self.proposals)} "
                             f"proposals for {len(self.target_ids)} tokens")
        if self.confidences is not None and \
                list(map(len, self.confidences)) != list(map(len, self.proposals)):
            raise ValueError("a trace's confidences must match its proposals, one per token")


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
        lines = [json.dumps(header)] + [json.dumps(_row(t)) for t in self.traces]
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
                        drafter=header["drafter"], tokenizer_fingerprint=fingerprint,
                        confidences=row.get("confidences"))
                  for row in map(json.loads, lines[1:])]
        return cls(target=header["target"], drafter=header["drafter"], max_k=header["max_k"],
                   traces=traces, tokenizer_fingerprint=fingerprint)


def _row(trace: Trace) -> dict:
    """One trace as a JSONL row; confidences only when there are any (older readers ignore it)."""
    row = {"prompt_ids": trace.prompt_ids, "target_ids": trace.target_ids,
           "proposals": trace.proposals, "draft_ms_per_token": trace.draft_ms_per_token}
    if trace.confidences is not None:
        row["confidences"] = trace.confidences
    return row


def record_traces(drafter, prompts_ids: Sequence[Sequence[int]],
                  target_outputs: Sequence[Sequence[int]], max_k: int, progress=None) -> list[Trace]:
    """Drive a real drafter greedily along each target output, one proposal per position.

    The context grows by one target token per position; rolling the drafter back to the context
    after each proposal keeps the KV of the context, so each position costs one fed token plus
    max_k - 1 drafted ones, not a prefill. A drafter that reports confidences
    (drafters.base.reports_confidence) has them recorded too. `progress` is an optional rich
    Progress.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    greedy = Sampling()
    options = {"with_confidence": True} if reports_confidence(drafter) else {}
    task = progress.add_task(f"recording {drafter.name}", total=sum(map(len, target_outputs))) \
        if progress is not None else None
    traces = []
    for prompt, target in zip(prompts_ids, target_outputs, strict=True):
        context = list(prompt)
        drafter.rollback(0)
        proposals: list[list[int]] = []
        confidences: list[list[float]] | None = [] if options else None
        seconds = 0.0
        for token in target:
            started = time.perf_counter()
            proposal = drafter.propose(context, max_k, greedy, **options)
            seconds += time.perf_counter() - started
            proposals.append(list(proposal.token_ids))
            if confidences is not None:
                confidences.append([round(c, 6) for c in proposal.confidence])
            drafter.rollback(len(context))
            context.append(token)
            if task is not None:
                progress.advance(task)
        drafted = sum(map(len, proposals))
        traces.append(Trace(list(prompt), list(target), proposals,
                            seconds * 1e3 / drafted if drafted else 0.0, drafter.name,
                            drafter.tokenizer_fingerprint, confidences))
    return traces


class TraceDivergence(RuntimeError):
    """A replayed context left the recorded greedy path (a sampling session, or a lossy server)."""


class TraceDrafter:
    """Replays a Trace behind the Drafter protocol; deterministic (q = one-hot).

    `device_profile` (anything with draft_seconds(k), e.g. edge_client.profiles.DeviceProfile)
    sets the latency apropose() emulates; without one it is the recorded draft_ms_per_token * k.
    A trace recorded with confidences stops drafts early like its drafter (min_confidence).
    """

    def __init__(self, trace: Trace, device_profile=None) -> None:
        self.trace = trace
        self.device_profile = device_profile
        self.name = f"trace:{trace.drafter}" if trace.drafter else "trace"
        self.tokenizer_fingerprint = trace.tokenizer_fingerprint
        self._drafted_to: list[int] | None = None   # context + proposal of the last proposal

    @property
    def reports_confidence(self) -> bool:
        """Early stops need the recorded confidences; older traces have none."""
        return self.trace.confidences is not None

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None, *, min_confidence: float = 0.0,
                with_confidence: bool = False) -> Proposal:
        if not sampling.greedy:
            raise ValueError("a trace replays greedy drafts only: use temperature 0")
        self._drafted_to = None
        position, drafted = self._locate(context)
        proposals, target, confidences = self.trace.proposals, self.trace.target_ids, self.trace.confidences
        if position < len(proposals):
            tokens = list(proposals[position][drafted:drafted + k])
            if not tokens:
                raise TraceDivergence(f"the context holds all {drafted} tokens recorded after "
                                      f"position {position}: record traces with a larger max_k")
            confidence = list(confidences[position][drafted:drafted + k]) if confidences is not None else None
        else:
            # Past the recorded output: the target's own tokens where there are any, else repeat.
            tokens = list(target[position:position + k]) or [context[-1]]
            confidence = [1.0] * len(tokens) if confidences is not None else None
        if confidence is not None and min_confidence > 0:
            stop = stop_index(confidence, min_confidence)
            tokens, confidence = tokens[:stop], confidence[:stop]
        self._drafted_to = list(context) + tokens
        scored = confidence is not None and (with_confidence or min_confidence > 0)
        return Proposal(tokens, None, confidence if scored else None)

    async def apropose(self, context: Sequence[int], k: int, sampling: Sampling,
                       generator: torch.Generator | None = None, **options) -> Proposal:
        """propose() after the emulated drafting time, without a thread.

        A draft costs the device profile's time for the tokens drafted (k, or fewer after an
        early stop); continuing right where the last proposal ended (the drafter's KV is warm:
        pipelined drafting) skips the per-round overhead. Off the recorded path the drafting
        time is spent all the same, then TraceDivergence is raised.
        """
        warm = self._drafted_to is not None and list(context) == self._drafted_to
        try:
            proposal = self.propose(context, k, sampling, generator, **options)
        except TraceDivergence:
            await asyncio.sleep(self.draft_seconds(k, warm))
            raise
        confidence = proposal.confidence
        stopped_early = bool(confidence) and confidence[-1] < options.get("min_confidence", 0.0)
        await asyncio.sleep(self.draft_seconds(len(proposal.token_ids) if stopped_early else k, warm))
        return proposal

    def draft_seconds(self, k: int, warm: bool = False) -> float:
        """Emulated time to draft k tokens; warm: without the per-round overhead."""
        if self.device_profile is not None:
            overhead = self.device_profile.draft_seconds(0) if warm else 0.0
            return self.device_profile.draft_seconds(k) - overhead
        return k * self.trace.draft_ms_per_token / 1e3

    def rollback(self, length: int) -> None:
        """Stateless: the position comes from the context length."""

    def _locate(self, context: Sequence[int]) -> tuple[int, int]:
        """(position, drafted): the context is the prompt, the target's first `position` output
        tokens, then the first `drafted` tokens the drafter proposed at that position (its own
        greedy continuation: drafting ahead of a verdict continues after its own draft). Raises
        when the context left the recorded path.

        Example: target [4, 5, 6], proposals[2] == [8, 3]: prompt + [4, 5] -> (2, 0);
        prompt + [4, 5, 8] -> (2, 1), so a proposal of 1 there is [3]; prompt + [4, 5, 9] raises.
        """
        prompt, target = self.trace.prompt_ids, self.trace.target_ids
        if len(context) < len(prompt) or list(context[:len(prompt)]) != prompt:
            raise self._diverged(context)
        output = context[len(prompt):]
        position = 0
        while position < min(len(output), len(target)) and output[position] == target[position]:
            position += 1
        if position == len(target):          # past the recorded output: anything goes after it
            return len(output), 0
        drafted = list(output[position:])
        if drafted != self.trace.proposals[position][:len(drafted)]:
            raise self._diverged(context)
        return position, len(drafted)

    def _diverged(self, context: Sequence[int]) -> TraceDivergence:
        return TraceDivergence(
            f"context of {len(context)} tokens is not the trace's prompt ({len(self.trace.prompt_ids)} "
            f"tokens) followed by the target's greedy output and the drafter's own proposal after "
            f"it: a trace replays only the greedy path")
