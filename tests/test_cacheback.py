"""Cacheback: an LRU table of leader n-grams and the followers seen after them, shared by every
session a drafter serves, bounded in memory. Its lossless runs are in test_lossless and
test_sampling_e2e."""
from __future__ import annotations

import pytest

from drafters import load_drafter
from drafters.cacheback import CachebackDrafter, FollowerTable
from sled.wire.sampling import Sampling

GREEDY = Sampling()


def test_a_draft_is_the_latest_follower_of_the_contexts_leader_then_of_its_own_tail():
    drafter = CachebackDrafter(leader=2, follower=2)
    context = [5, 6, 7, 8, 1, 9, 5, 6, 3, 3, 7, 8, 2, 2, 5, 6]
    drafter.observe(context)
    # (5, 6) was followed by (7, 8) and later by (3, 3): the later one wins; then (3, 3) -> (7, 8)
    assert drafter.propose(context, 4, GREEDY).token_ids == [3, 3, 7, 8]
    assert drafter.propose(context, 3, GREEDY).token_ids == [3, 3, 7]


def test_what_one_session_wrote_drafts_for_another():
    drafter = load_drafter("cacheback:leader=2:follower=3")
    drafter.observe([1, 2, 3, 10, 11, 12, 13, 4])
    assert drafter.propose([9, 9, 10, 11], 3, GREEDY).token_ids == [12, 13, 4]


def test_a_growing_context_adds_each_pair_once_its_follower_is_complete():
    drafter = CachebackDrafter(leader=1, follower=2)
    context = [1, 2, 3]
    drafter.observe(context)
    assert drafter.table.followers((2,)) == []          # (2) -> (3, ?) not complete yet
    context += [4, 2]
    drafter.observe(context)
    assert drafter.propose(context, 2, GREEDY).token_ids == [3, 4]
    assert drafter.table.followers((3,)) == [(4, 2)]


async def test_a_session_feeds_the_shared_table_its_prompt_and_output(serve, models):
    from edge_client.drafting import SharedDrafter
    from edge_client.session import generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    shared = SharedDrafter(CachebackDrafter(leader=1, follower=1))
    result = await generate(server_stub(await serve(models["llama"])), shared,
                            SessionRequest([3, 4, 5], max_new_tokens=6))
    output = [3, 4, 5, *result.token_ids]
    table = shared.inner.table
    assert table.followers((output[-2],))[0] == (output[-1],)   # the last token, after the end


def test_no_leader_in_the_table_still_drafts_the_last_token():
    assert CachebackDrafter().propose([4, 5, 6], 3, GREEDY).token_ids == [6, 6, 6]


def test_the_table_is_bounded_in_leaders_and_followers():
    table = FollowerTable(size=2, width=2)
    for follower in [(1,), (2,), (3,)]:
        table.add((0,), follower)
    assert table.followers((0,)) == [(3,), (2,)]          # the oldest follower went
    table.add((7,), (1,))
    table.followers((0,))                                 # a lookup keeps (0,) recent
    table.add((8,), (1,))
    assert len(table) == 2 and table.followers((7,)) == [] and table.followers((0,))


@pytest.mark.parametrize("spec,message", [
    ("cacheback:leader=0", "leader must be at least 1"),
    ("cacheback:depth=3", "bad cacheback option 'depth=3'"),
    ("cacheback:width=x", "bad cacheback option 'width=x'"),
])
def test_bad_cacheback_specs_are_refused_naming_the_option(spec, message):
    with pytest.raises(ValueError, match=message):
        load_drafter(spec)
