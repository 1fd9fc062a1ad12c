"""Session.commit: where a verdict's tokens are cut, and what counts as accepted."""
from __future__ import annotations

import pytest

from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from verify_server.acceptance import Outcome
from verify_server.session import Session


def session(max_new: int = 10, eos: int = 2, stop: frozenset[int] = frozenset()) -> Session:
    return Session(prompt_ids=[5, 6], sampling=Sampling(), max_new_tokens=max_new,
                   end_ids=stop | {eos}, stop_ids=stop)


def test_full_run_plus_bonus_is_committed():
    s = session()
    assert s.commit(Outcome(3, [7, 8, 9, 4])) == ([7, 8, 9, 4], pb.FINISH_REASON_UNSPECIFIED, 3)
    assert s.generated == [7, 8, 9, 4] and s.round == 1 and s.last_token == 4


def test_eos_inside_an_accepted_run_drops_the_rest_and_their_acceptance():
    s = session()
    emitted, finish, accepted = s.commit(Outcome(3, [7, 2, 9, 4]))
    assert (emitted, finish, accepted) == ([7, 2], pb.FINISH_REASON_EOS, 2)
    assert s.finished and s.generated == [7, 2]


def test_stop_id_is_reported_as_stop():
    s = session(stop=frozenset({9}))
    assert s.commit(Outcome(1, [9, 4]))[:2] == ([9], pb.FINISH_REASON_STOP)


@pytest.mark.parametrize("max_new, emitted", [(1, [7]), (2, [7, 8]), (4, [7, 8, 9, 4])])
def test_length_limit_cuts_exactly(max_new, emitted):
    s = session(max_new=max_new)
    out, finish, accepted = s.commit(Outcome(3, [7, 8, 9, 4]))
    assert out == emitted and s.remaining == 0
    assert finish == pb.FINISH_REASON_LENGTH and accepted == min(3, len(emitted))


def test_verify_budget_leaves_room_for_the_extra_token():
    s = session(max_new=5)
    s.commit(Outcome(1, [7, 8]))
    assert s.remaining == 3 and s.verifiable(8) == 2 and s.verifiable(1) == 1
