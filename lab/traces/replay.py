"""Replaying a recorded drafter (lab.traces.format) behind the Drafter protocol.

Replaying at context prompt + [5] returns proposals[1][:k] (target output [5, 6, 7]). A device
drafting ahead of a verdict (pipelining) also asks after its own drafted tokens: prompt + [5] +
proposals[1][:1] returns proposals[1][1:1 + k], the drafter's own greedy continuation.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import numpy as np

from drafters.base import Proposal, stop_index
from drafters.capabilities import Capabilities
from edge_client.emulation import late
from lab.traces.format import Trace, TraceSet
from sled.wire.sampling import Sampling


class TraceDivergence(RuntimeError):
    """A replayed context left the recorded greedy path (a sampling session, or a lossy server)."""


class TraceDrafter:
    """Replays a Trace behind the Drafter protocol; deterministic (q = one-hot).

    `device_profile` (anything with draft_seconds(draft_len), e.g. lab.profiles.DeviceProfile)
    sets the latency apropose() emulates; without one it is the recorded draft_ms_per_token per
    drafted token.
    A trace recorded with confidences stops drafts early like its drafter (min_confidence).
    """

    def __init__(self, trace: Trace, device_profile=None,
                 on_paced: Callable[[bool], None] | None = None) -> None:
        self.trace = trace
        self.device_profile = device_profile
        self.on_paced = on_paced      # after every paced proposal: late (True) or on time
        self.name = f"trace:{trace.drafter}" if trace.drafter else "trace"
        self.tokenizer_fingerprint = trace.tokenizer_fingerprint
        self._drafted_to: list[int] | None = None   # context + proposal of the last proposal

    @property
    def capabilities(self) -> Capabilities:
        """Early stops need the recorded confidences; older traces have none."""
        return Capabilities(confidence=self.trace.confidences is not None, awaitable=True)

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: np.random.Generator | None = None, *, min_confidence: float = 0.0,
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
                                      f"position {position}: record traces with a larger --max-draft-len")
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
                       generator: np.random.Generator | None = None, **options) -> Proposal:
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
        await self._pace(self.draft_seconds(len(proposal.token_ids) if stopped_early else k, warm))
        return proposal

    async def _pace(self, seconds: float) -> None:
        """Sleep the drafting time, and say whether this host's loop gave it back late."""
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        if self.on_paced is not None:
            self.on_paced(late(time.perf_counter() - started, seconds))

    def draft_seconds(self, draft_len: int, warm: bool = False) -> float:
        """Emulated time to draft draft_len tokens; warm: without the per-round overhead."""
        if self.device_profile is not None:
            overhead = self.device_profile.draft_seconds(0) if warm else 0.0
            return self.device_profile.draft_seconds(draft_len) - overhead
        return draft_len * self.trace.draft_ms_per_token / 1e3

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


class TraceSetDrafter:
    """A device's drafter that replays a whole TraceSet: each proposal comes from the trace whose
    prompt starts the context (the longest such prompt), so one device serves every prompt the
    traces were made for. Deterministic and greedy only, like TraceDrafter; a context no trace
    starts raises TraceDivergence naming how many prompts the set holds.

    It drafts in no time: the daemon's board emulation (edge_client.emulation.PacedDrafter) paces
    it to the board's drafting speed, as it paces any drafter.
    """

    def __init__(self, traces: TraceSet, source: str = "") -> None:
        self.traces = traces
        self.name = f"trace:{source or traces.drafter}"
        self.tokenizer_fingerprint = traces.tokenizer_fingerprint
        self._replays = [TraceDrafter(trace) for trace in traces.traces]
        self._by_prompt = sorted(range(len(traces.traces)),
                                 key=lambda i: -len(traces.traces[i].prompt_ids))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(confidence=all(replay.capabilities.confidence
                                           for replay in self._replays), awaitable=True)

    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: np.random.Generator | None = None, **options) -> Proposal:
        return self._replay(context).propose(context, k, sampling, generator, **options)

    async def apropose(self, context: Sequence[int], k: int, sampling: Sampling,
                       generator: np.random.Generator | None = None, **options) -> Proposal:
        return await self._replay(context).apropose(context, k, sampling, generator, **options)

    def rollback(self, length: int) -> None:
        """Stateless: the trace and the position come from the context."""

    def _replay(self, context: Sequence[int]) -> TraceDrafter:
        for i in self._by_prompt:
            prompt = self.traces.traces[i].prompt_ids
            if len(context) >= len(prompt) and list(context[:len(prompt)]) == prompt:
                return self._replays[i]
        raise TraceDivergence(f"no trace of the set's {len(self._replays)} starts with this "
                              f"context of {len(context)} tokens: a trace set replays only the "
                              "prompts it was made for")


def load_trace_drafter(path: str, q_support: int = 32) -> TraceSetDrafter:
    """The `trace:FILE` drafter spec (registered for drafters.load_drafter as a `sled.drafters`
    entry point): the trace file's set, replayed. q_support is unused (q is one-hot)."""
    if not path:
        raise ValueError("bad drafter spec 'trace:': use trace:FILE, a sled trace file (.jsonl)")
    try:
        traces = TraceSet.load(path)
    except FileNotFoundError:
        raise ValueError(f"drafter trace:{path}: no such trace file") from None
    except (ValueError, KeyError) as exc:
        raise ValueError(f"drafter trace:{path}: {exc}") from None
    return TraceSetDrafter(traces, source=path)
