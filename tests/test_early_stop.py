"""Confidence early stop: a draft ends after the first token its drafter is unsure of, live and
replayed from a trace, and sessions that stop early are still the target's output."""
from __future__ import annotations

import asyncio
import math
import time

import grpc
import numpy as np
import pytest
import torch

from conftest import greedy_reference
from drafters.base import KVDrafter, confidence_options, reports_confidence, stop_index
from drafters.hf import HFDrafter
from drafters.ngram import NgramDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from lab.profiles import DeviceProfile
from lab.traces import Trace, TraceDrafter, TraceSet, record_traces
from sled.wire.sampling import Sampling
from sled.v1.verifier_pb2_grpc import VerifierStub

VOCAB = 16
GREEDY = Sampling()


class ScriptedDrafter(KVDrafter):
    """Drafts token (position % VOCAB) at each position, with softmax max confidence[position]."""

    name, tokenizer_fingerprint = "scripted", None

    def __init__(self, confidence: dict[int, float]) -> None:
        super().__init__()
        self.confidence = confidence

    def _run(self, tokens: list[int]) -> np.ndarray:  # [vocab]
        position = len(self._seen) + len(tokens)            # of the token these logits draft
        c = self.confidence.get(position, 0.99)
        logits = np.full(VOCAB, math.log((1 - c) / (VOCAB - 1)), dtype=np.float32)
        logits[position % VOCAB] = math.log(c)
        return logits

    def _truncate(self, length: int) -> int:
        return length


def test_a_draft_stops_right_after_its_first_unsure_token():
    drafter = ScriptedDrafter({3: 0.9, 4: 0.8, 5: 0.3, 6: 0.9})
    proposal = drafter.propose([1, 2, 3], 5, GREEDY, min_confidence=0.5)
    assert proposal.token_ids == [3, 4, 5]
    assert proposal.confidence == pytest.approx([0.9, 0.8, 0.3])
    assert drafter.evaluated == 3 + 2          # the context, then 3 and 4; nothing after 5


def test_an_unsure_first_token_is_still_drafted():
    drafter = ScriptedDrafter({3: 0.2})
    assert drafter.propose([1, 2, 3], 4, GREEDY, min_confidence=0.5).token_ids == [3]


def test_min_confidence_zero_changes_nothing():
    confidence = {3: 0.9, 4: 0.3, 5: 0.1}
    plain = ScriptedDrafter(confidence).propose([1, 2, 3], 4, GREEDY)
    zero = ScriptedDrafter(confidence).propose([1, 2, 3], 4, GREEDY, min_confidence=0.0)
    assert plain == zero and plain.token_ids == [3, 4, 5, 6] and plain.confidence is None
    scored = ScriptedDrafter(confidence).propose([1, 2, 3], 4, GREEDY, with_confidence=True)
    assert scored.token_ids == plain.token_ids
    assert scored.confidence == pytest.approx([0.9, 0.3, 0.1, 0.99])


def test_stop_index_and_who_takes_the_keyword():
    assert stop_index([0.9, 0.3, 0.8], 0.5) == 2
    assert stop_index([0.1, 0.9], 0.5) == 1
    assert stop_index([0.9, 0.8], 0.5) == 2
    assert stop_index([0.9, 0.8], 0.0) == 2
    scripted = ScriptedDrafter({})
    assert reports_confidence(scripted) and not reports_confidence(NgramDrafter())
    assert confidence_options(scripted, 0.4) == {"min_confidence": 0.4}
    assert confidence_options(scripted, 0.0) == {}
    assert confidence_options(NgramDrafter(), 0.4) == {}    # nothing to stop on: drafts k


def test_confidence_is_the_drafters_probability_of_its_token(drafter_models, tokenizer, prompts):
    model = drafter_models["llama"]
    drafter = HFDrafter(model, tokenizer)
    greedy = drafter.propose(prompts[0], 3, GREEDY, with_confidence=True)
    with torch.no_grad():
        probs = model(torch.tensor([prompts[0]])).logits[0, -1].softmax(-1)
    assert greedy.confidence[0] == pytest.approx(float(probs.max()), rel=1e-6)
    sampling = Sampling(temperature=0.8, top_k=10)
    sampled = drafter.propose(prompts[0], 3, sampling, np.random.default_rng(1),
                              with_confidence=True)
    for token, q, confidence in zip(sampled.token_ids, sampled.q, sampled.confidence):
        assert confidence == q.probs[q.ids.index(token)]


# --- traces: recorded confidences let an emulated device stop where its drafter would ----------

MAX_K = 6


@pytest.fixture(scope="module")
def traces(models, drafter_models, tokenizer, prompts):
    targets = [greedy_reference(models["llama"], p, 12) for p in prompts[:4]]
    return record_traces(HFDrafter(drafter_models["llama"], tokenizer), prompts[:4], targets, MAX_K)


def median_confidence(traces) -> float:
    values = sorted(c for t in traces for row in t.confidences for c in row)
    return values[len(values) // 2]


def test_traces_record_confidences_and_replay_early_stops(traces, drafter_models, tokenizer, tmp_path):
    assert all(list(map(len, t.confidences)) == list(map(len, t.proposals)) for t in traces)
    loaded = TraceSet.load(TraceSet("tiny", "hf", MAX_K, traces).save(tmp_path / "t.jsonl")).traces
    assert [t.confidences for t in loaded] == [t.confidences for t in traces]
    threshold = median_confidence(traces)
    stopped = 0
    for trace in loaded[:2]:
        replay = TraceDrafter(trace)
        assert reports_confidence(replay)
        for position in range(len(trace.target_ids)):
            context = trace.prompt_ids + trace.target_ids[:position]
            live = HFDrafter(drafter_models["llama"], tokenizer).propose(
                context, MAX_K, GREEDY, min_confidence=threshold)
            replayed = replay.propose(context, MAX_K, GREEDY, min_confidence=threshold)
            assert replayed.token_ids == live.token_ids
            stopped += len(live.token_ids) < MAX_K
    assert stopped > 0


def test_traces_without_confidences_load_and_draft_whole(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"sled_traces": 1, "target": "t", "drafter": "d", "max_k": 2}\n'
                    '{"prompt_ids": [1], "target_ids": [4, 5], "proposals": [[4, 5], [5, 7]]}\n')
    trace = TraceSet.load(path).traces[0]
    assert trace.confidences is None
    replay = TraceDrafter(trace)
    assert not reports_confidence(replay) and confidence_options(replay, 0.9) == {}
    assert replay.propose([1], 2, GREEDY, min_confidence=0.9).token_ids == [4, 5]
    with pytest.raises(ValueError, match="confidences must match"):
        Trace([1], [4], [[4, 5]], confidences=[[0.5]])


async def test_an_emulated_early_stop_takes_less_drafting_time():
    trace = Trace([1], [4, 5, 6, 7], [[4, 5, 6, 7]] * 4, confidences=[[0.9, 0.1, 0.9, 0.9]] * 4)
    slow = DeviceProfile("slow", draft_ms_per_token=50.0, round_overhead_ms=0.0)
    started = time.perf_counter()
    proposal = await TraceDrafter(trace, slow).apropose([1], 4, GREEDY, min_confidence=0.5)
    assert proposal.token_ids == [4, 5]
    assert 0.1 <= time.perf_counter() - started < 0.19       # 2 tokens drafted, not 4


# --- end to end: early stops through the server are still the target's output ------------------

@pytest.mark.parametrize("pipeline", [False, True])
async def test_sessions_that_stop_early_are_lossless(serve, models, drafter_models, tokenizer,
                                                     prompts, traces, pipeline):
    model = models["llama"]
    threshold = median_confidence(traces)
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        results = await asyncio.gather(*(
            generate(stub, HFDrafter(drafter_models["llama"], tokenizer),
                     SessionRequest(p, max_new_tokens=20, ignore_eos=True),
                     settings=RoundSettings(draft_len=6, min_confidence=threshold, pipeline=pipeline))
            for p in prompts[:4]))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, 20)
    drafts = [s.verified for r in results for s in r.round_stats[:-2]]
    assert min(drafts) < 6 and max(drafts) > 1             # some drafts stopped early, not all


async def test_min_confidence_zero_drafts_as_before(serve, models, drafter_models, tokenizer, prompts):
    model = models["llama"]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        runs = [await generate(stub, HFDrafter(drafter_models["llama"], tokenizer),
                               SessionRequest(prompts[2], max_new_tokens=16, ignore_eos=True),
                               settings=RoundSettings(draft_len=4, **options))
                for options in ({}, {"min_confidence": 0.0})]
    assert runs[0].token_ids == runs[1].token_ids == greedy_reference(model, prompts[2], 16)
    assert [s.verified for s in runs[0].round_stats] == [s.verified for s in runs[1].round_stats]


async def test_emulated_devices_stop_early_and_stay_lossless(serve, models, traces):
    server = await serve(models["llama"])
    threshold = median_confidence(traces)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        results = await asyncio.gather(*(
            generate(stub, TraceDrafter(t, DeviceProfile("fast", 0.5, 0.5)),
                     SessionRequest(t.prompt_ids, max_new_tokens=len(t.target_ids)),
                     settings=RoundSettings(draft_len=MAX_K, min_confidence=threshold))
            for t in traces))
    assert [r.token_ids for r in results] == [t.target_ids for t in traces]
    assert any(s.verified < MAX_K for r in results for s in r.round_stats[:-2])
