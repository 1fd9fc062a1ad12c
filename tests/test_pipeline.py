"""Pipelined drafting: drafting ahead while a verdict is in flight keeps the output the target's,
keeps the tokens drafted ahead only when the verdict went the optimistic way, and leaves a seeded
sampling run's text as it is without it."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from conftest import greedy_reference
from drafters.base import Proposal
from drafters.hf import HFDrafter
from edge_client.session import RoundSettings, generate
from edge_client.speculation import Speculation
from edge_client.wire import SessionRequest
from lab.link import link_transport
from lab.profiles import DeviceProfile, Link, LinkProfile
from lab.traces import Trace, TraceDrafter
from sled.wire.sampling import Sampling
from sled.v1.verifier_pb2_grpc import VerifierStub
from test_sampling_e2e import total_variation, unseeded_tv_bound
from verify_server.warp import warp

MAX_NEW = 24
LINK = LinkProfile("test", rtt_ms=6.0, jitter_ms=1.0, bandwidth_mbps=0.0)
SLOW_LINK = LinkProfile("slow", 30.0, 0.0, 0.0)
DEVICE = DeviceProfile("test", draft_ms_per_token=2.0, round_overhead_ms=1.0)


# --- Speculation on its own ----------------------------------------------------------------------

def counting_step(fail_at: int | None = None, unsure_at: int | None = None):
    """A drafter that drafts len(context) after any context; raises or is unsure at a length."""
    async def step(context: list[int], sampling: Sampling) -> Proposal:
        await asyncio.sleep(0)
        if len(context) == fail_at:
            raise RuntimeError("off the recorded path")
        return Proposal([len(context)], confidence=[0.1 if len(context) == unsure_at else 0.9])
    return step


async def test_speculation_keeps_its_tokens_only_on_the_optimistic_verdict():
    # Context [0, 1] + draft [2, 3] in flight: guess 4, then 5, 6, 7 drafted after it.
    speculation = Speculation(counting_step(), [0, 1, 2, 3], in_flight=2, cap=3, sampling=Sampling())
    await asyncio.sleep(0.05)         # the verdict takes a while: the speculation reaches its cap
    await speculation.finish()
    assert (speculation.guess, speculation.tokens) == (4, [5, 6, 7])
    assert speculation.kept(2, [2, 3, 4]).token_ids == [5, 6, 7]   # all accepted, bonus == guess
    assert speculation.kept(2, [2, 3, 9]) is None                  # the bonus is not the guess
    assert speculation.kept(1, [2, 8]) is None                     # a draft token was rejected


async def test_speculation_stops_quietly_on_a_drafter_error_and_after_an_unsure_token():
    failing = Speculation(counting_step(fail_at=6), [0, 1, 2, 3], in_flight=2, cap=5, sampling=Sampling())
    await asyncio.sleep(0.05)
    await failing.finish()
    assert failing.tokens == [5] and not failing.ended
    unsure = Speculation(counting_step(unsure_at=6), [0, 1, 2, 3], 2, 5, Sampling(), min_confidence=0.5)
    await asyncio.sleep(0.05)
    await unsure.finish()
    assert unsure.tokens == [5, 6] and unsure.ended


# --- end to end ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,k", [("llama", 1), ("llama", 3), ("llama", 6), ("gemma3", 4),
                                    ("gemma3", "adaptive")])
async def test_pipelined_sessions_match_generate(serve, models, drafter_models, tokenizer, prompts,
                                                  arch, k):
    """Eight concurrent devices with a noisy drafter over a link with some delay."""
    model = models[arch]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        results = await asyncio.gather(*(
            generate(stub, HFDrafter(drafter_models[arch], tokenizer),
                     SessionRequest(p, max_new_tokens=MAX_NEW),
                     settings=RoundSettings(draft_len=k, pipeline=True),
                     transport=link_transport(Link(LINK, seed=i)))
            for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(model, prompt, MAX_NEW)
    assert sum(r.pipelined_tokens for r in results) == sum(s.pipelined for r in results for s in r.round_stats)


async def test_a_drafter_that_agrees_with_the_target_drafts_ahead(serve, models, tokenizer, prompts):
    """The target as its own drafter: every draft is accepted and every guess is the bonus, so
    each round's draft was drafted while the previous verdict was in flight."""
    model = models["llama"]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        plain, pipelined = [await generate(stub, HFDrafter(model, tokenizer),
                                           SessionRequest(prompts[1], max_new_tokens=MAX_NEW,
                                                          ignore_eos=True),
                                           settings=RoundSettings(draft_len=3, pipeline=on),
                                           transport=link_transport(Link(SLOW_LINK)))
                            for on in (False, True)]
    assert plain.token_ids == pipelined.token_ids == greedy_reference(model, prompts[1], MAX_NEW)
    assert plain.pipelined_tokens == 0
    assert pipelined.pipelined_tokens >= 3 * (pipelined.rounds - 2)
    assert pipelined.rounds == plain.rounds


async def test_emulated_device_drafts_ahead_instead_of_after_the_verdict(serve, models, prompts):
    """A perfect drafter on an emulated device: with pipelining the drafting hides behind the
    round trip, so the device's turns between verdicts nearly vanish."""
    model = models["llama"]
    target = greedy_reference(model, prompts[0], MAX_NEW)
    trace = Trace(prompts[0], target, [target[i:i + 8] or [target[-1]] for i in range(len(target))])
    device = DeviceProfile("pi-ish", draft_ms_per_token=5.0, round_overhead_ms=1.0)
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        runs = [await generate(stub, TraceDrafter(trace, device),
                               SessionRequest(trace.prompt_ids, max_new_tokens=len(target)),
                               settings=RoundSettings(draft_len=3, pipeline=on),
                               transport=link_transport(Link(LinkProfile("slow", 40.0, 0.0, 0.0))))
                for on in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids == target
    turns = [sum(s.draft_ms for s in run.round_stats[1:]) for run in runs]
    assert turns[1] < 0.5 * turns[0]
    assert runs[1].pipelined_tokens > 0


async def test_wrong_guesses_are_discarded(serve, models, prompts):
    """Drafts after even positions are right, after odd ones start wrong. With k = 3 every draft
    starts at an even position and is accepted whole, but the guess (drafted at an odd one) is
    never the bonus: the tokens drafted ahead are all thrown away, and the output is the target's."""
    model = models["llama"]
    target = greedy_reference(model, prompts[3], MAX_NEW)
    wrong = (max(target) + 1) % 300

    def proposal(i: int) -> list[int]:
        right = target[i:i + 8] or [target[-1]]
        return right if i % 2 == 0 else [wrong] + right[1:]

    trace = Trace(prompts[3], target, [proposal(i) for i in range(len(target))])
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(VerifierStub(channel), TraceDrafter(trace, DEVICE),
                                SessionRequest(trace.prompt_ids, max_new_tokens=len(target)),
                                settings=RoundSettings(draft_len=3, pipeline=True),
                                transport=link_transport(Link(SLOW_LINK)))
    assert result.token_ids == target
    assert result.pipelined_tokens == 0
    assert all(s.accepted == s.verified == 3 for s in result.round_stats[:-1])


async def test_seeded_sampling_pipelines_and_repeats(serve, models, drafter_models, tokenizer,
                                                     prompts):
    """A seeded session's tokens are fixed by its seed and positions (keyed sampling), so it
    drafts ahead like any other and gives the same text as without pipelining."""
    server = await serve(models["llama"])
    stub = VerifierStub(grpc.aio.insecure_channel(server.address))

    async def run(seed: int, pipeline: bool):
        return await generate(stub, HFDrafter(drafter_models["llama"], tokenizer, q_support=8),
                              SessionRequest(prompts[0], max_new_tokens=12, ignore_eos=True,
                                             sampling=Sampling(1.0, top_k=2, seed=seed)),
                              settings=RoundSettings(draft_len=1, pipeline=pipeline))

    seeds = range(12)
    ahead = await asyncio.gather(*(run(seed, True) for seed in seeds))
    plain = await asyncio.gather(*(run(seed, False) for seed in seeds))
    assert [r.token_ids for r in ahead] == [r.token_ids for r in plain]
    assert sum(r.pipelined_tokens for r in ahead) > 0
    assert sum(r.pipelined_tokens for r in plain) == 0
    assert len({tuple(r.token_ids) for r in ahead}) > 1        # the seeds sample apart


async def test_seeded_sampling_repeats_whatever_lengths_the_policy_picks(
        serve, models, drafter_models, tokenizer, prompts):
    """"adaptive" and "auto" pick lengths from timings and the server's load: two devices with
    different histories split a seeded session's rounds apart, and give the same text."""
    from edge_client.draft_policy import DraftPolicy
    from edge_client.session import AUTO_FIRST_DRAFT_LEN

    server = await serve(models["gemma3"])
    stub = VerifierStub(grpc.aio.insecure_channel(server.address))

    async def run(draft_len, policy=None, seed=7):
        return await generate(stub, HFDrafter(drafter_models["gemma3"], tokenizer),
                              SessionRequest(prompts[1], max_new_tokens=30, ignore_eos=True,
                                             sampling=Sampling(temperature=0.9, top_p=0.95, seed=seed)),
                              policy=policy,
                              settings=RoundSettings(draft_len=draft_len, max_draft_len=16))

    eager = DraftPolicy(max_draft_len=16, acceptance=0.99, draft_ms=0.01, round_ms=500.0)
    shy = DraftPolicy(max_draft_len=16, acceptance=0.05, draft_ms=50.0, round_ms=1.0)
    assert eager.choose() != shy.choose()
    fixed, learned_a, learned_b, auto = [await run(*args) for args in
                                         ((AUTO_FIRST_DRAFT_LEN,), ("adaptive", eager),
                                          ("adaptive", shy), ("auto",))]
    assert learned_a.token_ids == learned_b.token_ids == auto.token_ids == fixed.token_ids
    lengths = [[s.verified for s in run.round_stats] for run in (fixed, learned_a, learned_b)]
    assert len({tuple(split) for split in lengths}) == 3      # three ways of splitting the rounds
    assert max(lengths[1]) > AUTO_FIRST_DRAFT_LEN               # eager drafts longer


SAMPLING = Sampling(temperature=1.0, top_k=2)
SAMPLES = 1200


def third_token_given(model, prompt: list[int], pairs: list[tuple[int, int]]) -> torch.Tensor:
    """p(t3 | t1, t2) for each pair (t1, t2): [len(pairs), vocab]."""
    with torch.no_grad():
        return warp(model(torch.tensor([prompt + list(pair) for pair in pairs])).logits[:, -1], SAMPLING)


async def test_pipelined_sampling_still_follows_the_target_distribution(serve, models, drafter_models,
                                                                         tokenizer, prompts):
    """Unseeded sampling pipelines: the third token's draft was often drafted ahead, after a
    guessed bonus. Given the first two tokens the third still follows the target's p, both over
    all sessions and over the sessions whose third token came from a draft made ahead. Four
    tokens, not three: with one token left the server verifies no draft, so a third token would
    be the bonus, whatever was drafted ahead."""
    model = models["llama"]
    prompt = prompts[0]
    server = await serve(model, max_batch_sessions=64)
    stub = VerifierStub(grpc.aio.insecure_channel(server.address))
    gate = asyncio.Semaphore(48)

    async def one(_):
        async with gate:
            return await generate(stub, HFDrafter(drafter_models["llama"], tokenizer, q_support=8),
                                  SessionRequest(prompt, max_new_tokens=4, ignore_eos=True,
                                                 sampling=SAMPLING),
                                  settings=RoundSettings(draft_len=1, pipeline=True))

    results = await asyncio.gather(*(one(i) for i in range(SAMPLES)))
    ahead = [any(s.pipelined for s in r.round_stats) for r in results]
    assert sum(ahead) > SAMPLES // 5
    pairs = sorted({tuple(r.token_ids[:2]) for r in results})
    p3 = dict(zip(pairs, third_token_given(model, prompt, pairs)))
    for chosen in (results, [r for r, a in zip(results, ahead) if a]):
        # The mixture of p(t3 | t1, t2) over the (t1, t2) these sessions emitted.
        want = sum(p3[tuple(r.token_ids[:2])] for r in chosen) / len(chosen)
        support = int((want > 1e-4).sum())
        distance = total_variation([r.token_ids[2] for r in chosen], want)
        # The support's tokens and one bin for the rest; a false alarm once in a million runs.
        assert distance < unseeded_tv_bound(support + 1, len(chosen)), (distance, support, len(chosen))
