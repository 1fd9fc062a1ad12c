"""Sampling oracle, end to end through the server: emitted tokens follow the target's
distribution (the distance shrinks as samples grow), seeded (keyed sampling) and unseeded
(rejection sampling), and seeded requests repeat exactly."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch

from drafters.cacheback import CachebackDrafter
from drafters.hf import HFDrafter
from drafters.hier import HierDrafter
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2_grpc as pb_grpc
from verify_server.warp import warp

SAMPLING = Sampling(temperature=1.0, top_k=12)
COUNTS = (100, 800)


class GreedyDrafter(HFDrafter):
    """Deterministic drafter (q = one-hot): always its own argmax, whatever the sampling params."""

    def propose(self, context, k, sampling, generator=None):
        return super().propose(context, k, Sampling(), None)


def exact_distributions(model, prompt: list[int], sampling: Sampling):
    """p(t1) and the marginal p(t2) = sum_t1 p(t1) p(t2 | t1), computed directly from the target."""
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], sampling)          # [vocab]
        support = p1.nonzero().flatten()
        batch = torch.tensor([prompt + [int(t)] for t in support])
        p2_given = warp(model(batch).logits[:, -1], sampling)                        # [n, vocab]
    return p1, (p1[support, None] * p2_given).sum(0)


def total_variation(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=p.shape[0]).double()
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def unseeded_tv_bound(categories: int, n: int, false_alarm: float = 1e-6) -> float:
    """TV that n unseeded draws from a distribution over `categories` outcomes exceed with
    probability at most `false_alarm` (Bretagnolle-Huber-Carol: P(TV >= t) <= 2^k exp(-2 n t^2)).
    For tests whose draws cannot be seeded, so that CI fails on a defect, not on chance."""
    return math.sqrt((categories * math.log(2) + math.log(1 / false_alarm)) / (2 * n))


async def sample_pairs(server, drafter_factory, prompt, n: int, concurrency: int = 64,
                       seeded: bool = True):
    """n sessions of two tokens each; seeded: session i has seed i (keyed sampling), else no
    seed (rejection sampling, OS-seeded streams)."""
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    gate = asyncio.Semaphore(concurrency)

    async def one(seed: int):
        async with gate:
            result = await generate(stub, drafter_factory(),
                                    SessionRequest(prompt, max_new_tokens=2, ignore_eos=True,
                                                   sampling=Sampling(SAMPLING.temperature,
                                                                     SAMPLING.top_k,
                                                                     seed=seed if seeded else None)),
                                    settings=RoundSettings(draft_len=2))
            return result.token_ids

    return await asyncio.gather(*(one(seed) for seed in range(n)))


@pytest.mark.parametrize("drafter,engine,seeded", [
    ("hf-sparse-q", "paged", True), ("greedy-deterministic", "paged", True),
    ("cacheback-shared", "paged", True), ("hier", "paged", True), ("hf-sparse-q", "flex", True),
    ("hf-sparse-q", "paged", False), ("greedy-deterministic", "paged", False)])
async def test_emitted_tokens_converge_to_target_distribution(serve, models, drafter_models,
                                                              tokenizer, prompts, drafter, engine,
                                                              seeded):
    """Seeded sessions (keyed sampling) and unseeded ones (rejection sampling, with a sparse q
    and with a deterministic drafter) emit the target's distribution."""
    model = models["llama"]
    prompt = prompts[0]
    p1, p2 = exact_distributions(model, prompt, SAMPLING)
    if drafter == "hf-sparse-q":
        factory = lambda: HFDrafter(drafter_models["llama"], tokenizer, q_support=8)  # noqa: E731
    elif drafter == "hier":   # sampled: the model drafter's own q
        factory = lambda: HierDrafter(  # noqa: E731
            CachebackDrafter(), HFDrafter(drafter_models["llama"], tokenizer))
    elif drafter == "cacheback-shared":   # one table for every session, q one-hot
        shared = CachebackDrafter(leader=1, follower=2)
        factory = lambda: shared  # noqa: E731
    else:
        factory = lambda: GreedyDrafter(drafter_models["llama"], tokenizer)  # noqa: E731
    # the flex engine on CPU is flex's dense reference: a small pool keeps it quick
    server = await serve(model, max_batch_sessions=64, engine=engine,
                         kv_budget=(4 << 20) if engine == "paged" else (3 << 19))
    pairs = await sample_pairs(server, factory, prompt, COUNTS[-1], seeded=seeded)
    assert server.metrics.value("sled_accepted_tokens_total") > 0  # drafts were really accepted
    assert server.metrics.value("sled_accepted_tokens_total") < server.metrics.value("sled_draft_tokens_total")

    for position, p in ((0, p1), (1, p2)):
        distances = [total_variation([pair[position] for pair in pairs[:n]], p) for n in COUNTS]
        support = int((p > 1e-4).sum())
        if not seeded:      # draws that cannot repeat: a bound chance crosses once in a million
            assert distances[-1] < unseeded_tv_bound(support + 1, COUNTS[-1]), (position, distances)
            continue
        # Expected TV of an n-sample empirical distribution is about 0.4 * sqrt(support / n).
        bound = 0.8 * math.sqrt(support / COUNTS[-1])
        assert distances[-1] < bound, (position, distances, bound)
        assert distances[-1] < distances[0], (position, distances)


async def test_drafters_own_distribution_is_detectably_different(models, drafter_models, prompts):
    """The test above has power: the drafter's q alone is far outside its bound."""
    p1, _ = exact_distributions(models["llama"], prompts[0], SAMPLING)
    q1, _ = exact_distributions(drafter_models["llama"], prompts[0], SAMPLING)
    support = int((p1 > 1e-4).sum())
    assert 0.5 * float((p1 - q1).abs().sum()) > 0.8 * math.sqrt(support / COUNTS[-1])


async def test_seeded_requests_repeat_exactly(serve, models, drafter_models, tokenizer, prompts):
    server = await serve(models["gemma3"])
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))

    async def run(seed: int):
        return (await generate(stub, HFDrafter(drafter_models["gemma3"], tokenizer),
                               SessionRequest(prompts[1], max_new_tokens=40, ignore_eos=True,
                                              sampling=Sampling(temperature=0.9, top_p=0.95, seed=seed)),
                               settings=RoundSettings(draft_len=4))).token_ids

    first, again, concurrent_a, concurrent_b = await asyncio.gather(run(7), run(7), run(7), run(8))
    assert first == again == concurrent_a
    assert first != concurrent_b
