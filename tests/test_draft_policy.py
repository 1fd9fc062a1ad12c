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


def test_acceptance_counts_only_the_tokens_a_round_judged():
    """A draft of 8 rejected at its second token passed one token and failed one; the six after
    it were never judged, so the per-token rate is 1/2, not 1/8."""
    policy = DraftPolicy()
    for _ in range(30):
        policy.observe(verified=8, accepted=1, draft_ms=80, round_ms=50)
    assert policy.acceptance == pytest.approx(0.5, abs=1e-3)
    for _ in range(30):
        policy.observe(verified=4, accepted=4, draft_ms=40, round_ms=50)   # all accepted
    assert policy.acceptance == 0.99


def test_round_cost_is_learned_per_draft_length():
    policy = DraftPolicy(acceptance=0.9, draft_ms=20, round_ms=150, max_draft_len=8)
    assert policy.choose() == 8                    # one round cost for every length: long pays
    for _ in range(3):
        policy.observe(verified=6, accepted=6, draft_ms=120, round_ms=400)
        policy.observe(verified=4, accepted=4, draft_ms=80, round_ms=140)
    assert policy.round_cost(6) == pytest.approx(400) and policy.round_cost(4) == pytest.approx(140)
    assert policy.round_cost(5) == policy.round_cost(4)        # nearest length seen, shorter on a tie
    assert policy.round_cost(8) == policy.round_cost(6)
    assert policy.choose() == 5                    # unseen 5 is guessed to cost what 4 does
    for _ in range(3):
        policy.observe(verified=5, accepted=5, draft_ms=100, round_ms=380)
    assert policy.choose() == 4                    # longer drafts cost rounds that do not pay


def test_drafting_ahead_pays_when_whole_drafts_are_often_accepted_and_round_trips_are_long():
    assert DraftPolicy(acceptance=0.9, draft_ms=20, round_ms=150).pipelining_pays(4)
    assert not DraftPolicy(acceptance=0.4, draft_ms=20, round_ms=50).pipelining_pays(4)
    # A round trip shorter than one draft step: the guess is not even drafted when the verdict comes.
    assert not DraftPolicy(acceptance=0.95, draft_ms=20, round_ms=10).pipelining_pays(2)
    # Long drafts are rarely accepted whole, so drafting ahead of them pays less often.
    policy = DraftPolicy(acceptance=0.8, draft_ms=20, round_ms=60)
    assert policy.pipelining_pays(1) and not policy.pipelining_pays(12)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DraftPolicy(max_draft_len=0)


async def test_adaptive_sessions_stay_lossless_and_vary_k(serve, models, drafter_models, prompts):
    import grpc

    from conftest import greedy_reference
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from lab.link import link_transport
    from lab.profiles import Link, LinkProfile
    from sled.v1.verifier_pb2_grpc import VerifierStub

    model = models["llama"]
    server = await serve(model)
    # A few ms of round trip: drafting a few tokens pays, how many depends on recent acceptance.
    link = Link(LinkProfile("lan", rtt_ms=4.0, jitter_ms=0.5, bandwidth_mbps=0.0))
    async with grpc.aio.insecure_channel(server.address) as channel:
        result = await generate(VerifierStub(channel), HFDrafter(drafter_models["llama"]),
                                SessionRequest(prompts[0], max_new_tokens=40, ignore_eos=True),
                                settings=RoundSettings(draft_len="adaptive"),
                                transport=link_transport(link))
    assert result.token_ids == greedy_reference(model, prompts[0], 40)
    assert len({stat.verified for stat in result.round_stats[:-3]}) > 1   # k chosen per round


async def test_one_policy_carries_over_a_devices_sessions(serve, models, drafter_models, prompts):
    import grpc

    from conftest import greedy_reference
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from sled.v1.verifier_pb2_grpc import VerifierStub

    model = models["llama"]
    server = await serve(model)
    policy = DraftPolicy(max_draft_len=6)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        first = await generate(stub, HFDrafter(drafter_models["llama"]),
                               SessionRequest(prompts[0], max_new_tokens=16, ignore_eos=True),
                               settings=RoundSettings(draft_len="adaptive"), policy=policy)
        learned, next_k = (policy.acceptance, policy.round_ms), policy.choose()
        second = await generate(stub, HFDrafter(drafter_models["llama"]),
                                SessionRequest(prompts[1], max_new_tokens=16, ignore_eos=True),
                                settings=RoundSettings(draft_len="adaptive"), policy=policy)
    assert first.token_ids == greedy_reference(model, prompts[0], 16)
    assert second.token_ids == greedy_reference(model, prompts[1], 16)
    assert learned != (0.7, 20.0)                               # taught by the first session
    assert second.round_stats[0].verified == next_k             # and the second starts from it
