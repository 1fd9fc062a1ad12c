"""Recorded drafter traces and emulated devices: a trace replays exactly what its drafter
proposed, an emulated device through the real server is still lossless, and the emulated link
delays every message by at least its configured latency."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from conftest import greedy_reference
from drafters.hf import HFDrafter
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from lab.link import link_transport
from lab.profiles import DeviceProfile, Link, LinkProfile, device_profile, link_profile
from lab.traces import Trace, TraceDivergence, TraceDrafter, TraceSet, record_traces
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2_grpc as pb_grpc

MAX_NEW = 16
MAX_K = 6
FAST_DEVICE = DeviceProfile("test", draft_ms_per_token=0.5, round_overhead_ms=0.5)
FAST_LINK = LinkProfile("test", rtt_ms=2.0, jitter_ms=0.5, bandwidth_mbps=100.0)


@pytest.fixture(scope="module")
def targets(models, prompts):
    return [greedy_reference(models["llama"], p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def traces(drafter_models, tokenizer, prompts, targets):
    drafter = HFDrafter(drafter_models["llama"], tokenizer, name="hf:noisy")
    return record_traces(drafter, prompts, targets, MAX_K)


def test_trace_set_round_trips_through_jsonl(traces, tmp_path):
    saved = TraceSet(target="tiny", drafter="hf:noisy", max_draft_len=MAX_K, traces=traces,
                     tokenizer_fingerprint=traces[0].tokenizer_fingerprint)
    path = saved.save(tmp_path / "traces.jsonl")
    assert len(path.read_text().splitlines()) == 1 + len(traces)
    loaded = TraceSet.load(path)
    assert (loaded.target, loaded.drafter, loaded.max_draft_len) == ("tiny", "hf:noisy", MAX_K)
    assert loaded.tokenizer_fingerprint == saved.tokenizer_fingerprint
    for got, want in zip(loaded.traces, traces, strict=True):
        assert (got.prompt_ids, got.target_ids, got.proposals) == \
               (want.prompt_ids, want.target_ids, want.proposals)
        assert got.draft_ms_per_token == pytest.approx(want.draft_ms_per_token)
        assert got.tokenizer_fingerprint == want.tokenizer_fingerprint


def test_load_refuses_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f():"}\n')
    with pytest.raises(ValueError, match="not a sled trace file"):
        TraceSet.load(path)


def test_a_trace_replays_what_its_drafter_proposes_at_every_position(traces, drafter_models,
                                                                      tokenizer):
    """A fresh drafter asked at each prefix of the target's output drafts what the replay returns."""
    for trace in traces[:4]:
        replay = TraceDrafter(trace)
        assert all(len(p) == MAX_K for p in trace.proposals)
        for position in range(len(trace.target_ids)):
            context = trace.prompt_ids + trace.target_ids[:position]
            live = HFDrafter(drafter_models["llama"], tokenizer)
            for k in (1, 3, MAX_K):
                want = live.propose(context, k, Sampling())
                live.rollback(len(context))
                assert replay.propose(context, k, Sampling()).token_ids == want.token_ids
        assert replay.tokenizer_fingerprint == live.tokenizer_fingerprint


def test_replay_past_the_end_and_off_the_greedy_path():
    trace = Trace([1, 9], [4, 5, 6], [[4, 5], [5, 7], [6, 2]], drafter="hf:x")
    replay = TraceDrafter(trace)
    assert replay.name == "trace:hf:x"
    assert replay.propose([1, 9, 4], 2, Sampling()).token_ids == [5, 7]
    assert replay.propose([1, 9, 4, 5, 6], 3, Sampling()).token_ids == [6]   # repeats the last
    with pytest.raises(TraceDivergence, match="greedy"):
        replay.propose([1, 9, 5], 2, Sampling())
    with pytest.raises(ValueError, match="greedy"):
        replay.propose([1, 9], 2, Sampling(temperature=1.0))
    with pytest.raises(ValueError, match="one proposal per target token"):
        Trace([1], [4, 5], [[4]])


async def test_apropose_waits_the_device_profiles_drafting_time(traces):
    slow = DeviceProfile("slow", draft_ms_per_token=10.0, round_overhead_ms=5.0)
    replay = TraceDrafter(traces[0], slow)
    started = time.perf_counter()
    proposal = await replay.apropose(traces[0].prompt_ids, 3, Sampling())
    assert time.perf_counter() - started >= 0.035
    assert proposal.token_ids == traces[0].proposals[0][:3]


async def test_link_adds_at_least_its_round_trip_time():
    link = Link(LinkProfile("slow", rtt_ms=30.0, jitter_ms=5.0, bandwidth_mbps=1.0), seed=3)
    for _ in range(3):
        started = time.perf_counter()
        await link.uplink(500)
        await link.downlink(500)
        # half the rtt each way plus 2 x 500 bytes at 1 Mbit/s
        assert time.perf_counter() - started >= 0.030 + 0.008


async def test_a_streaming_link_keeps_its_rate_not_one_latency_per_message():
    link = Link(LinkProfile("far", rtt_ms=100.0, jitter_ms=0.0, bandwidth_mbps=0.0))
    received = time.perf_counter()
    for _ in range(10):  # ten messages the local stack took at the same moment
        await link.downlink(100, received)
    assert 0.05 <= time.perf_counter() - received < 0.2


def test_profile_specs():
    assert device_profile("pi5").draft_ms_per_token == 20.0
    assert device_profile("pi5").draft_seconds(4) == pytest.approx((4 * 20 + 3) / 1e3)
    assert link_profile("loopback").rtt_ms == 0.0
    wifi = link_profile("wifi:rtt_ms=20,jitter_ms=1")
    assert (wifi.rtt_ms, wifi.jitter_ms, wifi.bandwidth_mbps) == (20.0, 1.0, 100.0)
    with pytest.raises(ValueError, match="unknown device profile"):
        device_profile("pi9")
    with pytest.raises(ValueError, match="not one of"):
        link_profile("wifi:latency=3")


@pytest.mark.parametrize("draft_len", [1, 4, "auto"])
async def test_emulated_devices_through_the_server_are_lossless(serve, models, traces, draft_len):
    server = await serve(models["llama"])
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        results = await asyncio.gather(*(
            generate(stub, TraceDrafter(trace, FAST_DEVICE),
                     SessionRequest(trace.prompt_ids, max_new_tokens=len(trace.target_ids)),
                     settings=RoundSettings(draft_len=draft_len),
                     transport=link_transport(Link(FAST_LINK, seed=i)))
            for i, trace in enumerate(traces)))
    for result, trace in zip(results, traces):
        assert result.token_ids == trace.target_ids
        assert len(result.token_times) == len(result.token_ids)
        assert result.token_times == sorted(result.token_times)
        assert result.token_times[0] >= 2 * FAST_LINK.rtt_ms / 1e3   # open + first round
    assert 0 < sum(r.accepted_tokens for r in results) < sum(r.draft_tokens for r in results)


async def test_server_side_generation_matches_generate_for_concurrent_devices(serve, models, prompts):
    """Centralized serving (GENERATION_MODE_SERVER): no drafts, one verdict per token, lossless."""
    model = models["gemma3"]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        results = await asyncio.gather(*(
            generate_server_side(stub, SessionRequest(prompt, MAX_NEW),
                                 transport=link_transport(Link(FAST_LINK, seed=i)))
            for i, prompt in enumerate(prompts)))
    for result, prompt in zip(results, prompts):
        reference = greedy_reference(model, prompt, MAX_NEW)
        assert result.token_ids == reference
        assert result.finish_reason == ("eos" if len(reference) < MAX_NEW else "length")
        assert result.rounds == len(reference) and result.draft_tokens == 0
        assert len(result.token_times) == len(reference)
        assert result.token_times == sorted(result.token_times)
