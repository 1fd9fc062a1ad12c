"""HintPolicy: a session starts drafts with the server's SAT hints only while its own rounds show
them beating its drafter, scored for free on the rounds where the drafter drafted anyway."""
from __future__ import annotations

from edge_client.hint_policy import HintPolicy, leading_matches


def round_with_shadow(policy: HintPolicy, hints, drafter_accepted: int, emitted, draft_len: int = 4):
    """One verdict bringing hints the policy may take, then the next verdict on the drafter's own
    draft: whether the hints were taken."""
    taken = policy.take(hints, draft_len)
    if not taken:
        policy.observe(0, drafter_accepted, emitted)
    return taken


def test_leading_matches():
    assert leading_matches([1, 2, 3], [1, 2, 9, 3]) == 2
    assert leading_matches([5], [1]) == 0
    assert leading_matches([1, 2], [1]) == 1


def test_hints_worse_than_the_drafter_are_never_used():
    policy = HintPolicy(lookahead=4)
    for _ in range(50):
        assert not round_with_shadow(policy, [1, 9, 9, 9], drafter_accepted=4, emitted=[1, 2, 3, 4, 5])
    assert not policy.using and policy.hint_run < policy.drafter_run


def test_hints_better_than_the_drafter_are_used_after_min_rounds():
    policy = HintPolicy(lookahead=3, min_rounds=3)
    taken = [round_with_shadow(policy, [1, 2, 3], drafter_accepted=1, emitted=[1, 2, 3])
             for _ in range(3)]
    assert taken == [False, False, False] and policy.using
    assert policy.take([1, 2, 3], 4)                       # the next verdict's hints start the draft


def test_used_hints_are_dropped_once_they_fall_below_the_drafter():
    policy = HintPolicy(lookahead=3, min_rounds=1)
    round_with_shadow(policy, [1, 2, 3], drafter_accepted=1, emitted=[1, 2, 3])
    assert policy.using
    for _ in range(10):
        if not policy.using:
            break
        policy.observe(hinted=3, accepted=0, emitted=[7])   # the hints now fail at once
    assert not policy.using
    assert not policy.take([1, 2, 3], 4)


def test_unused_hints_are_scored_over_the_positions_a_draft_would_use():
    """A draft of 2 would have used 2 hints: the hints' third is not scored."""
    policy = HintPolicy(lookahead=4, min_rounds=1, smoothing=1.0)
    round_with_shadow(policy, [1, 2, 3, 4], drafter_accepted=2, emitted=[1, 2, 3], draft_len=2)
    assert (policy.hint_run, policy.drafter_run) == (2.0, 2.0) and not policy.using   # a tie: no


def test_hints_are_asked_for_every_round_only_while_used():
    policy = HintPolicy(lookahead=3, probe_every=4)
    assert [policy.ask() for _ in range(8)] == [3, 0, 0, 0, 3, 0, 0, 0]
    policy.using = True
    assert [policy.ask() for _ in range(3)] == [3, 3, 3]
    assert HintPolicy(lookahead=0).ask() == 0


def test_round_settings_refuse_an_unknown_hint_use():
    import pytest

    from edge_client.session import RoundSettings

    assert RoundSettings(lookahead=2, hints="always").hints == "always"
    with pytest.raises(ValueError, match="hints must be measured or always, got 'sometimes'"):
        RoundSettings(hints="sometimes")
