"""The device's draft-length policy: expected tokens per second, learned from its own rounds."""
from __future__ import annotations

import pytest

from edge_client.draft_policy import DraftPolicy, expected_tokens


def test_expected_tokens_matches_the_geometric_series():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    a = 0.8
    assert expected_tokens(a, 3) == pytest.approx(1 + a + a**2 + a**3)


def test_slow_links_and_good_drafters_get_long_drafts():
    assert DraftPolicy(acceptance=0.9, draft_ms=2, round_ms=60).choose() == 16


def test_slow_drafters_on_a_fast_link_get_short_drafts():
    assert DraftPolicy(acceptance=0.6, draft_ms=20, round_ms=5).choose() == 1


def test_longer_round_trips_never_shorten_the_draft():
    ks = [DraftPolicy(acceptance=0.8, draft_ms=10, round_ms=rtt).choose() for rtt in (5, 20, 50, 200)]
    assert ks == sorted(ks) and ks[0] < ks[-1]


def test_the_servers_suggestion_caps_the_draft():
    policy = DraftPolicy(acceptance=0.95, draft_ms=1, round_ms=100)
    assert policy.choose() == 16
    assert policy.choose(suggested=3) == 3
    assert policy.choose(suggested=0) == 16          # no suggestion


def test_observing_rounds_moves_the_estimates():
    policy = DraftPolicy(acceptance=0.7, draft_ms=2, round_ms=20)
    before = policy.choose()
    assert before > 1
    for _ in range(20):
        policy.observe(verified=4, accepted=0, draft_ms=80, round_ms=5)   # all rejected, slow drafts
    assert policy.acceptance < 0.05 and policy.draft_ms == pytest.approx(20, rel=0.01)
    assert policy.round_ms == pytest.approx(5, rel=0.01)
    assert policy.choose() == 1 < before


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DraftPolicy(max_k=0)


async def test_adaptive_sessions_stay_lossless_and_vary_k(serve, models, drafter_models, prompts):
    import grpc

    from conftest import greedy_reference
    from drafters.hf import HFDrafter
    from edge_client.session import generate
    from sled.v1.verifier_pb2_grpc import VerifierStub

    model = models["llama"]
    server = await serve(model)
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(VerifierStub(channel), HFDrafter(drafter_models["llama"]), prompts[0],
                                max_new_tokens=40, draft_len="adaptive", ignore_eos=True)
    assert result.token_ids == greedy_reference(model, prompts[0], 40)
    assert len({stat.verified for stat in result.round_stats[:-3]}) > 1   # k chosen per round
