"""Keyed sampling (sled.wire.keyed): a seeded request's tokens are exact draws from the target's
distribution, fixed by the seed and their positions, so the same on every path that produces
them: device drafts of any length, the server's own decoding, and moves between them."""
from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
import torch

from drafters.base import choose_token
from drafters.hf import HFDrafter
from edge_client.server_side import generate_server_side
from edge_client.session import RoundSettings, generate
from edge_client.wire import SessionRequest
from sled.v1 import verifier_pb2_grpc as pb_grpc
from sled.wire.keyed import gumbel, keyed_pick
from sled.wire.sampling import Sampling
from verify_server.acceptance import (Proposal, decide, greedy_chain, greedy_tree, keyed_targets,
                                      tree_positions)
from verify_server.engines.base import StepLogits
from verify_server.warp import warp

SEEDED = Sampling(temperature=0.9, top_k=12, seed=5)


def test_the_numbers_are_a_function_of_seed_position_and_id_and_look_gumbel():
    ids = np.arange(50_000)
    g = gumbel(7, 3, ids)
    assert np.array_equal(g, gumbel(7, 3, ids))
    assert not np.array_equal(g, gumbel(8, 3, ids)) and not np.array_equal(g, gumbel(7, 4, ids))
    assert np.array_equal(gumbel(7, 3, ids[100:200]), g[100:200])   # any subset, same numbers
    # standard Gumbel: mean Euler's gamma, variance pi^2 / 6
    assert abs(g.mean() - 0.5772) < 0.02 and abs(g.var() - math.pi ** 2 / 6) < 0.05


def test_the_pick_is_an_exact_draw_from_p_over_seeds_and_over_positions():
    """Gumbel-max: the keyed pick lands on each id with its probability."""
    p = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    ids = np.arange(len(p))
    n = 40_000
    for picks in ([keyed_pick(ids, p, seed, 9) for seed in range(n)],
                  [keyed_pick(ids, p, 9, position) for position in range(n)]):
        counts = np.bincount(picks, minlength=len(p)) / n
        assert 0.5 * np.abs(counts - p).sum() < 0.01, counts


def test_the_server_and_the_device_pick_the_same_token_from_the_same_distribution():
    """keyed_targets (server, torch) and choose_token (device, numpy): one rule, one hash."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    p = warp(logits, SEEDED)
    server = keyed_targets(p, SEEDED.seed, range(30, 36))
    device = [choose_token(logits[i].numpy(), SEEDED, q_support=40, position=30 + i)[0]
              for i in range(6)]
    assert server == device


def test_decide_verifies_a_seeded_row_greedily_on_the_keyed_picks():
    gen = torch.Generator().manual_seed(1)
    chain_logits = torch.randn(4, 16, generator=gen)
    tree_logits = torch.randn(5, 16, generator=gen)
    parents = (0, 1, 0, 3)
    picks = keyed_targets(warp(chain_logits, SEEDED), SEEDED.seed, range(20, 24))
    chain = [picks[0], picks[1], (picks[2] + 1) % 16]          # the third one is wrong
    tree_picks = keyed_targets(warp(tree_logits, SEEDED), SEEDED.seed,
                               tree_positions(parents, 20))
    tree = [(tree_picks[0] + 1) % 16, 3, tree_picks[0], tree_picks[3]]
    packed = torch.cat([chain_logits, tree_logits])
    logits = StepLogits(packed, [slice(0, 4), slice(4, 9)])
    outcomes = decide([Proposal(chain, SEEDED, position=20),
                       Proposal(tree, SEEDED, parents=parents, position=20)], logits)
    assert outcomes[0] == greedy_chain(picks, chain) and outcomes[0].emitted == picks[:3]
    assert outcomes[1] == greedy_tree(tree_picks, tree, parents) and outcomes[1].path == (3, 4)
    assert tree_positions(parents, 20) == [20, 21, 22, 21, 22]


def test_a_seeded_rows_sat_hints_are_the_keyed_picks_at_the_positions_they_guess():
    """The block of SAT slots after the accepted tokens guesses the positions after the
    emitted ones: a seeded row's hints are the keyed rule's picks there, not the argmax."""
    gen = torch.Generator().manual_seed(2)
    m, draft_len = 2, 2
    logits = torch.randn(draft_len + 1 + (draft_len + 1) * m, 16, generator=gen)
    picks = keyed_targets(warp(logits[:draft_len + 1], SEEDED), SEEDED.seed, range(40, 43))
    draft = [picks[0], (picks[1] + 1) % 16]                     # one accepted, then a correction
    step = StepLogits(logits, [slice(0, len(logits))])
    outcome = decide([Proposal(draft, SEEDED, lookahead=m, every_cut=True, position=40)], step)[0]
    assert outcome.emitted == picks[:2]
    first = draft_len + 1 + outcome.accepted * m                # the block after the accepted one
    want = keyed_targets(warp(logits[first:first + m], SEEDED), SEEDED.seed, range(42, 44))
    assert outcome.hints == want


async def seeded_run(server, drafter, prompt, draft_len: int, seed: int = 5,
                     movable: bool = False):
    """One seeded session of 32 tokens: drafted by DRAFTER, or decoded by the server alone
    (drafter None)."""
    stub = pb_grpc.VerifierStub(grpc.aio.insecure_channel(server.address))
    request = SessionRequest(prompt, max_new_tokens=32, ignore_eos=True, movable=movable,
                             sampling=Sampling(SEEDED.temperature, SEEDED.top_k, seed=seed))
    if drafter is None:
        return await generate_server_side(stub, request)
    return await generate(stub, drafter, request, settings=RoundSettings(draft_len=draft_len))


async def test_a_seeded_request_gives_the_same_tokens_on_every_path(serve, models, drafter_models,
                                                                     tokenizer, prompts):
    """Device drafts of length 2 and 5, the server decoding alone, and sessions the latency
    policy moves (to the server after their first round): one output per seed."""
    model = models["llama"]
    fixed = await serve(model)
    moving = await serve(model, placement="latency")

    def drafter():
        return HFDrafter(drafter_models["llama"], tokenizer)

    prompt = prompts[0]
    for seed in (5, 6):
        runs = await asyncio.gather(
            seeded_run(fixed, drafter(), prompt, 2, seed=seed),
            seeded_run(fixed, drafter(), prompt, 5, seed=seed),
            seeded_run(fixed, None, prompt, 0, seed=seed),
            seeded_run(moving, drafter(), prompt, 3, seed=seed, movable=True))
        outputs = [run.token_ids for run in runs]
        assert all(out == outputs[0] for out in outputs), (seed, outputs)
        assert len(outputs[0]) == 32
        assert runs[3].moves >= 1 and runs[3].placements.get("server", 0) > 0
    assert outputs[0] != (await seeded_run(fixed, drafter(), prompt, 2, seed=7)).token_ids


async def test_a_drafter_that_is_the_target_has_every_seeded_draft_accepted(serve, models,
                                                                            tokenizer, prompts):
    """q = p (the target drafting for itself, its whole top-k in q): the device's keyed picks
    are the target's, position for position, so no draft token is ever rejected."""
    model = models["llama"]
    server = await serve(model)
    result = await seeded_run(server, HFDrafter(model, tokenizer, q_support=32), prompts[1], 4)
    assert result.acceptance_rate == pytest.approx(1.0)
    assert server.metrics.value("sled_accepted_tokens_total") == \
        server.metrics.value("sled_draft_tokens_total") > 0


def test_a_seeded_row_without_its_position_is_refused():
    """The keyed rule needs each row's sequence position: a caller that forgets it would reuse
    one position's numbers every round, which is no longer a draw from p."""
    logits = StepLogits(torch.zeros(2, 8), [slice(0, 2)])
    with pytest.raises(ValueError, match="give Proposal.position"):
        decide([Proposal([1], SEEDED)], logits)
    unseeded = Sampling(SEEDED.temperature, SEEDED.top_k)
    assert decide([Proposal([1], unseeded, torch.Generator().manual_seed(0))], logits)[0] is not None
