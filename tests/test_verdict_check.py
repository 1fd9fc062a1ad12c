"""The device's rules for a verdict (edge_client.verdict_check), one verdict at a time: each rule
on its own, broken by a verdict that keeps every other, and each bound at its edge (the last value
that passes, the first that fails); then the server's advice, clamped to the device's largest
draft however large it is."""
from __future__ import annotations

import re
import tracemalloc
from dataclasses import dataclass, field, replace

import pytest

from drafters.base import Proposal
from edge_client import verdict_check
from edge_client.session import AUTO_FIRST_DRAFT_LEN
from edge_client.verdict_check import Asked, BrokenVerdict, advised_draft_len, check_verdict
from sled.v1 import verifier_pb2 as pb
from test_device_session import PROMPT, CountingDrafter, ScriptedServer, session

VOCAB = 320
GOES_ON, LENGTH, EOS = pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS
CHAIN = Proposal([4, 5, 6])
TREE = Proposal([4, 5, 8, 9], parents=[0, 1, 0, 3])   # root -> 4 -> 5, root -> 8 -> 9


def verdict(accepted: int, emitted: list[int], verified: int, finish=GOES_ON, round: int = 0,
            **more) -> pb.Verdict:
    return pb.Verdict(round=round, accepted=accepted, emitted_ids=emitted, verified=verified,
                      finish_reason=finish, **more)


def asked(proposal: Proposal | None = CHAIN, room: int = 12, **more) -> Asked:
    return Asked(0, room, VOCAB, proposal, **more)


def refused(lying: pb.Verdict, asking: Asked) -> str:
    """The problem check_verdict names for `lying` (it must refuse it)."""
    with pytest.raises(BrokenVerdict) as broken:
        check_verdict(lying, asking)
    return broken.value.problem


# --- honest verdicts ---------------------------------------------------------------------------

@pytest.mark.parametrize("proposal, honest", [
    (CHAIN, verdict(3, [4, 5, 6, 7], 3)),                      # accepted whole, a bonus
    (CHAIN, verdict(1, [4, 9], 3)),                            # a correction
    (CHAIN, verdict(2, [4, 5], 3, LENGTH)),                    # cut at the length
    (CHAIN, verdict(2, [4, 5, 6], 2)),                         # past the verified: may repeat
    (TREE, verdict(2, [8, 9, 1], 4)),                          # the second branch
    (TREE, verdict(1, [4, 2], 4)),
    (None, verdict(0, [7], 0)),                                # a server mode's step
], ids=["whole", "corrected", "cut", "unverified", "branch", "branch-prefix", "server-mode"])
def test_an_honest_verdict_keeps_every_rule(proposal, honest):
    check_verdict(honest, asked(proposal))


# --- each rule alone ---------------------------------------------------------------------------

# A verdict and a request that keep every rule: a chain's round 2, one draft token accepted and
# corrected, two hints of the two asked for; a tree's round 2, its second branch accepted whole.
HONEST = {"chain": (dict(round=2, accepted=1, emitted_ids=[4, 9], verified=3, hint_ids=[7, 8]),
                    Asked(2, 12, VOCAB, CHAIN, lookahead=2)),
          "tree": (dict(round=2, accepted=2, emitted_ids=[8, 9, 1], verified=4, hint_ids=[7, 8]),
                   Asked(2, 12, VOCAB, TREE, lookahead=2))}


@dataclass(frozen=True)
class Broken:
    """One rule broken by changing one thing of an honest exchange (HONEST[base])."""
    row: str                       # the rule's row in verdict_check's table
    problem: str                   # what check_verdict says
    verdict: dict = field(default_factory=dict)    # fields of the verdict changed
    asked: dict = field(default_factory=dict)      # ... or of what the device asked
    base: str = "chain"


ONE_RULE = {
    "round": Broken("round", "it answers round 3, the device waits for round 2", {"round": 3}),
    "finish-reason": Broken("round", "its finish reason 9 is none the protocol has",
                            {"finish_reason": 9}),
    "verified-of-sent": Broken("accepted", "it says 4 draft tokens were verified of 3 sent",
                               {"verified": 4}),
    "accepted-of-verified": Broken("accepted", "it accepts 1 draft tokens of 0 verified",
                                   {"verified": 0}),
    "undrafted": Broken("accepted", "its accepted tokens [5] are not what the device drafted",
                        {"emitted_ids": [5, 9]}),
    "cross-branch": Broken("accepted", "its accepted tokens [4, 9] are no branch of the device's "
                           "tree", {"emitted_ids": [4, 9, 1]}, base="tree"),
    "not-from-root": Broken("accepted", "its accepted tokens [5, 9] are no branch of the "
                            "device's tree", {"emitted_ids": [5, 9, 1]}, base="tree"),
    "one-of-the-targets": Broken("emitted", "it emits 3 tokens for 1 accepted: at most the "
                                 "accepted ones and one of the target's",
                                 {"emitted_ids": [4, 9, 9]}),
    "one-more-unless-finished": Broken("emitted", "it emits 2 tokens for 2 accepted without "
                                       "finishing", {"accepted": 2, "emitted_ids": [4, 5]}),
    "correction-is-the-draft": Broken("emitted", "the target's token after the accepted ones is "
                                      "the draft token it rejected (5)", {"emitted_ids": [4, 5]}),
    "past-max-new-tokens": Broken("totals", "it emits 2 tokens where 1 are left of the "
                                  "request's max_new_tokens", asked={"room": 1}),
    "reaches-without-finishing": Broken("totals", "it reaches max_new_tokens (2 tokens left) "
                                        "without finishing the session", asked={"room": 2}),
    "emitted-id": Broken("ids", f"it emits token {VOCAB}, outside the target's vocabulary of "
                         f"{VOCAB}", {"emitted_ids": [4, VOCAB]}),
    "hinted-id": Broken("ids", f"it hints token {VOCAB}, outside the target's vocabulary of "
                        f"{VOCAB}", {"hint_ids": [7, VOCAB]}),
    "hints": Broken("hints", "it hints 2 tokens where 1 were asked for", asked={"lookahead": 1}),
    "loose-in-exact": Broken("loose", "it accepts draft tokens loosely in a session that asked "
                             "for exact verification", {"loose_accepted": 1}),
    "loose-of-accepted": Broken("loose", "it accepts 2 tokens loosely of 1 accepted",
                                {"loose_accepted": 2}, {"loose": True}),
}


@pytest.mark.parametrize("base", sorted(HONEST))
def test_the_honest_exchanges_keep_every_rule(base):
    fields, asking = HONEST[base]
    check_verdict(pb.Verdict(**fields), asking)
    check_verdict(pb.Verdict(**fields), replace(asking, loose=True))


@pytest.mark.parametrize("name", sorted(ONE_RULE))
def test_a_verdict_that_breaks_one_rule_alone_is_refused_for_that_rule(name):
    broken = ONE_RULE[name]
    fields, asking = HONEST[broken.base]
    problem = refused(pb.Verdict(**{**fields, **broken.verdict}), replace(asking, **broken.asked))
    assert problem.startswith(broken.problem), problem


def test_every_rule_of_the_table_is_broken_alone_by_some_verdict():
    """The module's table of rules, row by row: each but the advice (clamped, not refused: below)
    has a verdict above that breaks it alone."""
    rows = re.findall(r"^    (\w+) {2,}\S", verdict_check.__doc__, re.MULTILINE)
    assert set(rows) == {broken.row for broken in ONE_RULE.values()} | {"advice"}, rows


# --- each bound at its edge --------------------------------------------------------------------

@pytest.mark.parametrize("finish", [GOES_ON, EOS], ids=["goes-on", "finished"])
def test_emitted_is_at_most_accepted_plus_one(finish):
    check_verdict(verdict(1, [4, 9], 3, finish), asked())
    assert "it emits 3 tokens for 1 accepted" in refused(verdict(1, [4, 9, 9], 3, finish), asked())
    check_verdict(verdict(3, [4, 5, 6, 7], 3, finish), asked())
    assert "it emits 5 tokens for 3 accepted" in refused(verdict(3, [4, 5, 6, 7, 8], 3, finish),
                                                          asked())


def test_emitting_exactly_what_is_left_passes_when_it_finishes_and_one_more_fails():
    whole = verdict(3, [4, 5, 6, 7], 3, LENGTH)
    check_verdict(whole, asked(room=4))
    check_verdict(verdict(3, [4, 5, 6, 7], 3), asked(room=5))          # one left: goes on
    assert "it emits 4 tokens where 3 are left" in refused(whole, asked(room=3))
    assert "reaches max_new_tokens (4 tokens left) without finishing" in refused(
        verdict(3, [4, 5, 6, 7], 3), asked(room=4))
    check_verdict(verdict(0, [9], 0, LENGTH), asked(None, room=1))      # a server mode's last
    assert "it emits 2 tokens where 1 are left" in refused(verdict(1, [9, 9], 1, LENGTH),
                                                            asked(None, room=1))


def test_the_last_id_of_the_vocabulary_passes_and_the_vocabulary_size_fails():
    check_verdict(verdict(1, [4, VOCAB - 1], 3), asked())
    assert f"it emits token {VOCAB}, outside" in refused(verdict(1, [4, VOCAB], 3), asked())
    check_verdict(verdict(0, [VOCAB - 1], 0), asked(None))
    assert f"it emits token {VOCAB}, outside" in refused(verdict(0, [VOCAB], 0), asked(None))
    check_verdict(verdict(1, [4, 9], 3, hint_ids=[VOCAB - 1]), asked(lookahead=1))
    assert f"it hints token {VOCAB}, outside" in refused(verdict(1, [4, 9], 3, hint_ids=[VOCAB]),
                                                          asked(lookahead=1))


def test_an_unknown_vocabulary_checks_no_id():
    check_verdict(verdict(1, [4, 1 << 31], 3), replace(asked(), vocab_size=0))


def test_hints_up_to_the_lookahead_pass_and_one_more_fails():
    check_verdict(verdict(3, [4, 5, 6, 7], 3, hint_ids=[1, 2, 3]), asked(lookahead=3))
    assert "it hints 4 tokens where 3 were asked for" in refused(
        verdict(3, [4, 5, 6, 7], 3, hint_ids=[1, 2, 3, 4]), asked(lookahead=3))
    assert "it hints 1 tokens where 0 were asked for" in refused(
        verdict(3, [4, 5, 6, 7], 3, hint_ids=[1]), asked())


# --- the server's advice -----------------------------------------------------------------------

@pytest.mark.parametrize("advice, followed", [(0, 0), (1, 1), (8, 8), (9, 8), (20_000_000, 8)])
def test_the_advice_is_clamped_to_the_devices_largest_draft(advice, followed):
    assert advised_draft_len(pb.Verdict(suggested_draft_len=advice), 8) == followed


@pytest.mark.parametrize("draft_len", ["auto", "adaptive"])
async def test_advice_of_twenty_million_tokens_drafts_at_most_the_devices_largest(draft_len):
    """A server that advises 20,000,000 tokens every round: the device drafts at most its
    max_draft_len, follows it ("auto") and allocates nothing the size of the advice."""
    server = ScriptedServer(suggest=20_000_000)
    device = session(server, CountingDrafter(), max_new=40, draft_len=draft_len, max_draft_len=8)
    tracemalloc.start()
    try:
        result = await device.run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.token_ids == list(range(len(PROMPT), len(PROMPT) + 40))
    assert max(len(draft) for draft in server.drafts) <= 8
    assert {s.suggested_draft_len for s in result.round_stats} == {8}
    if draft_len == "auto":
        assert [len(d) for d in server.drafts[:2]] == [AUTO_FIRST_DRAFT_LEN, 8]
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB traced"       # a 20M-token draft: > 150 MiB
