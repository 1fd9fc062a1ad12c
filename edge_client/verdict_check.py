"""What a device checks of every verdict before it keeps a token of it.

The device cannot check the target's own tokens (that is what it asks the server for), but it
can check everything else a verdict says against what the device sent and asked:

    round      the round the device waits for
    accepted   a path of its own draft (a prefix of a chain, a branch of a tree), at most what
               the server says it verified, and verified at most the draft
    emitted    the accepted tokens, then at most one of the server's own, so exactly
               accepted + 1 unless the verdict finishes (a cut at EOS, a stop id or the length);
               in a chain, a correction is never the draft token it replaced
    totals     never past max_new_tokens; reaching it finishes the session
    ids        every emitted and hinted id inside the target's vocabulary (when known)
    hints      at most the lookahead asked for
    loose      loose acceptance only in a session opened loose, and never more than accepted
    advice     suggested_draft_len clamped to the device's largest draft (max_draft_len)

A verdict that breaks a rule raises BrokenVerdict before any of its tokens is committed, shown
or counted: the session ends with that error, and its output is never labelled lossless.
Each check costs O(draft + emitted) after the O(1) length checks, so a verdict of 500,000
tokens is refused without reading them.

The advice is the one rule that clamps instead of refusing: it is no token of the output, and
an honest server may advise up to its own max_draft_tokens (32 by default), more than a device
drafts (16), so a device drafts min(advice, max_draft_len) and a suggested length of 20,000,000
costs it no more than its own largest draft.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from drafters.base import Proposal
from edge_client.transport import VerifyError
from sled.v1 import verifier_pb2 as pb
from sled.wire.tree import children

FINISH_REASONS = frozenset(pb.FinishReason.values())
PLACEMENTS = frozenset(pb.GenerationMode.values())


class BrokenVerdict(VerifyError):
    """The server sent a verdict that breaks the protocol's rules (a hostile, broken or buggy
    server): nothing of it was kept. Not a lost server, so no other server is asked to resume:
    the session ends here."""

    def __init__(self, problem: str) -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS,
                         f"the server's verdict breaks the protocol, so nothing of it was kept "
                         f"and the session ends: {problem}", "REASON_BROKEN_VERDICT")
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Asked:
    """What the device asked of one exchange: the verdict must answer it."""
    round: int                 # the Draft.round sent (server modes: the verdict's expected step)
    room: int                  # tokens the session may still emit (max_new_tokens less committed)
    vocab_size: int = 0        # the target's (ModelInfo.vocab_size); 0: unknown, ids unchecked
    proposal: Proposal | None = None   # the draft sent; None in a server mode (no draft)
    lookahead: int = 0         # SAT hint tokens asked for
    loose: bool = False        # the session was opened loose (Open.loose)
    movable: bool = False      # the session was opened movable (Open.movable)


def check_verdict(verdict: pb.Verdict, asked: Asked) -> None:
    """Raise BrokenVerdict naming the first rule `verdict` breaks; nothing when it keeps them."""
    problem = (_round_problem(verdict, asked) or _size_problem(verdict, asked)
               or _count_problem(verdict, asked) or _path_problem(verdict, asked)
               or _id_problem(verdict, asked))
    if problem:
        raise BrokenVerdict(problem)


def advised_draft_len(verdict: pb.Verdict, largest: int) -> int:
    """The verdict's suggested_draft_len, at most `largest` (the device's max_draft_len);
    0 when the server gave no advice."""
    return min(verdict.suggested_draft_len, largest)


def _round_problem(verdict: pb.Verdict, asked: Asked) -> str | None:
    if verdict.round != asked.round:
        return f"it answers round {verdict.round}, the device waits for round {asked.round}"
    if verdict.finish_reason not in FINISH_REASONS:
        return f"its finish reason {verdict.finish_reason} is none the protocol has"
    if verdict.HasField("placement"):
        if not asked.movable:
            return "it moves a session that was not opened movable"
        if verdict.placement not in PLACEMENTS:
            return f"it moves the session to placement {verdict.placement}, none the protocol has"
    return None


def _size_problem(verdict: pb.Verdict, asked: Asked) -> str | None:
    """The lengths, before any token is read."""
    emitted = len(verdict.emitted_ids)
    if emitted > asked.room:
        return (f"it emits {emitted} tokens where {asked.room} are left of the request's "
                "max_new_tokens")
    if emitted == asked.room and verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return f"it reaches max_new_tokens ({emitted} tokens left) without finishing the session"
    if len(verdict.hint_ids) > asked.lookahead:
        return f"it hints {len(verdict.hint_ids)} tokens where {asked.lookahead} were asked for"
    return None


def _count_problem(verdict: pb.Verdict, asked: Asked) -> str | None:
    drafted = len(asked.proposal.token_ids) if asked.proposal is not None else None
    accepted, emitted = verdict.accepted, len(verdict.emitted_ids)
    if drafted is not None and verdict.verified > drafted:
        return f"it says {verdict.verified} draft tokens were verified of {drafted} sent"
    if drafted is not None and accepted > verdict.verified:
        return f"it accepts {accepted} draft tokens of {verdict.verified} verified"
    if emitted > accepted + 1:
        return (f"it emits {emitted} tokens for {accepted} accepted: at most the accepted "
                "ones and one of the target's")
    if emitted < accepted + 1 and verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return (f"it emits {emitted} tokens for {accepted} accepted without finishing: a "
                "verdict that goes on emits the accepted ones and one of the target's")
    if verdict.loose_accepted and not asked.loose:
        return "it accepts draft tokens loosely in a session that asked for exact verification"
    if verdict.loose_accepted > accepted:
        return f"it accepts {verdict.loose_accepted} tokens loosely of {accepted} accepted"
    return None


def _path_problem(verdict: pb.Verdict, asked: Asked) -> str | None:
    """The accepted tokens (as far as the verdict emits them) are a path of the draft."""
    if asked.proposal is None:
        return None
    draft, parents = asked.proposal.token_ids, asked.proposal.parents
    kept = list(verdict.emitted_ids[:verdict.accepted])
    if parents is None:
        if kept != list(draft[:len(kept)]):
            return f"its accepted tokens {_shown(kept)} are not what the device drafted"
        rejected = verdict.accepted < verdict.verified and len(verdict.emitted_ids) > verdict.accepted
        if rejected and verdict.emitted_ids[verdict.accepted] == draft[verdict.accepted]:
            return ("the target's token after the accepted ones is the draft token it rejected "
                    f"({draft[verdict.accepted]})")
        return None
    if not _is_branch(kept, draft, parents):
        return f"its accepted tokens {_shown(kept)} are no branch of the device's tree"
    return None


def _is_branch(path: Sequence[int], draft: Sequence[int], parents: Sequence[int]) -> bool:
    """Whether `path` spells a walk from the tree's root down its edges (siblings may repeat a
    token, so every node that matches so far is followed)."""
    kids = children(parents)
    nodes = [0]
    for token in path:
        nodes = [child for node in nodes for child in kids[node] if draft[child - 1] == token]
        if not nodes:
            return False
    return True


def _id_problem(verdict: pb.Verdict, asked: Asked) -> str | None:
    if not asked.vocab_size:
        return None
    for name, ids in (("emits", verdict.emitted_ids), ("hints", verdict.hint_ids)):
        outside = [i for i in ids if i >= asked.vocab_size]
        if outside:
            return (f"it {name} token {outside[0]}, outside the target's vocabulary of "
                    f"{asked.vocab_size}")
    return None


def _shown(tokens: Sequence[int]) -> str:
    return str(list(tokens[:8]))[:-1] + (", ...]" if len(tokens) > 8 else "]")
