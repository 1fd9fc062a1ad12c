"""A session's drafter and the drafts it puts together.

A draft may start with a head it did not draft this turn: the server's SAT hints, or the tokens
drafted ahead while the last verdict was in flight (edge_client/speculation.py). The drafter
drafts the rest, after the head.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from drafters.base import Drafter, Proposal, SparseQ, confidence_options, tree_proposal
from drafters.capabilities import capabilities_of
from edge_client.speculation import Speculation
from sled.wire.sampling import DRAFTER_SEED_OFFSET, Sampling, new_generator
from sled.wire.tree import chain_parents, cut


@dataclass(frozen=True, slots=True)
class Head:
    """What starts the next draft: the server's SAT hints, or tokens drafted ahead."""
    proposal: Proposal
    hinted: bool = False     # the server's SAT hints (deterministic: q one-hot)
    ends: bool = False       # drafted ahead up to an early stop: the next draft ends with it


@dataclass(frozen=True, slots=True)
class Draft:
    """One round's draft, and how many of its tokens were not drafted this turn."""
    proposal: Proposal
    hinted: int = 0          # tokens from the server's SAT hints
    pipelined: int = 0       # tokens drafted while the previous verdict was in flight


class Proposer:
    """The device's drafter as one session uses it: the session's own random stream (seeded
    from the request's seed, apart from the server's), its early stop, and run in a thread; a
    drafter with an async apropose() (an emulated device) is awaited directly instead.
    tree=N > 1: drafts may be trees of up to N candidates per position, from a drafter that
    drafts trees (Capabilities.trees; a sampling session's trees are deterministic candidates), cut to
    max_draft_tokens tokens (the server's ServerLimits.max_draft_tokens: it refuses a longer
    draft)."""

    def __init__(self, drafter: Drafter, sampling: Sampling, min_confidence: float = 0.0,
                 tree: int = 1, max_draft_tokens: int = 32) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.min_confidence = min_confidence
        self.generator = new_generator(sampling, offset=DRAFTER_SEED_OFFSET)
        self.options = confidence_options(drafter, min_confidence)
        # a sampling session's trees carry no q (deterministic candidates): a drafter that samples
        # drafts its chain with q instead (KVDrafter branches only when greedy)
        self.capabilities = capabilities_of(drafter)
        self.tree = {"tree": tree} if tree > 1 and self.capabilities.trees else {}
        self.max_draft_tokens = max_draft_tokens

    async def propose(self, context: list[int], draft_len: int,
                      sampling: Sampling | None = None, branch: bool = False) -> Proposal:
        """draft_len tokens (fewer after an early stop) continuing context; branch: a tree may
        come back (Proposal.parents) when the session drafts trees."""
        how = self.sampling if sampling is None else sampling
        options = {**self.options, **self.tree} if branch else self.options
        if self.capabilities.awaitable:
            return await self.drafter.apropose(context, draft_len, how, self.generator, **options)
        return await asyncio.to_thread(self.drafter.propose, context, draft_len, how, self.generator,
                                       **options)

    async def draft(self, context: list[int], draft_len: int, head: Head | None) -> Draft:
        """A draft of draft_len tokens: the head's (all of them when it ends early), then the
        drafter's own after it."""
        if head is None:
            return Draft(self.fit(await self.propose(context, draft_len, branch=True)))
        taken = first(head.proposal, draft_len)
        rest = 0 if head.ends else draft_len - len(taken.token_ids)
        tail = await self.propose(context + taken.token_ids, rest, branch=True) if rest else None
        if head.hinted:
            return Draft(self.fit(with_hints(taken.token_ids, tail)), hinted=len(taken.token_ids))
        return Draft(self.fit(joined(taken, tail)), pipelined=len(taken.token_ids))

    def fit(self, proposal: Proposal) -> Proposal:
        """A tree cut to max_draft_tokens tokens (its first ones: still a tree); a chain as it is."""
        if proposal.parents is None or len(proposal.token_ids) <= self.max_draft_tokens:
            return proposal
        tokens, parents = cut(proposal.token_ids, proposal.parents, len(proposal.token_ids),
                              self.max_draft_tokens)
        return tree_proposal(tokens, parents)

    def speculate(self, context: list[int], in_flight: int, cap: int) -> Speculation:
        """Draft ahead, one token at a time, while the verdict on the last in_flight tokens of
        context is in flight (at most cap tokens)."""
        return Speculation(lambda path, how: self.propose(path, 1, how), context, in_flight, cap,
                           self.sampling, self.min_confidence)

    def rollback(self, length: int) -> None:
        """Forget the drafter's state past the first length context tokens."""
        self.drafter.rollback(length)

    def observe(self, context: list[int]) -> None:
        """Show a drafter that learns from committed text (Capabilities.observes) this session's."""
        if self.capabilities.observes:
            self.drafter.observe(context)


def with_hints(hints: list[int], proposal: Proposal | None) -> Proposal:
    """A draft that starts with the server's SAT hints (deterministic: q one-hot) and goes on
    with the drafter's own proposal from after them."""
    if proposal is None:
        return Proposal(list(hints), None)
    q = None
    if proposal.q is not None:
        q = [SparseQ([h], [1.0]) for h in hints] + list(proposal.q)
    return Proposal(list(hints) + list(proposal.token_ids), q,
                    parents=below(len(hints), proposal.parents))


def joined(head: Proposal, tail: Proposal | None) -> Proposal:
    """head's tokens, then tail's; q and confidences where both have them."""
    if tail is None:
        return head
    q = head.q + tail.q if head.q is not None and tail.q is not None else None
    confidence = head.confidence + tail.confidence \
        if head.confidence is not None and tail.confidence is not None else None
    return Proposal(head.token_ids + tail.token_ids, q, confidence,
                    below(len(head.token_ids), tail.parents))


def below(chain: int, parents: list[int] | None) -> list[int] | None:
    """The parents of a chain of `chain` tokens followed by a tree (`parents`) that grows from
    its last token; None when the tree is a chain too. below(2, [0, 0]) == [0, 1, 2, 2]."""
    if parents is None:
        return None
    return chain_parents(chain) + [parent + chain for parent in parents]


def first(proposal: Proposal, n: int) -> Proposal:
    """The first n tokens of a proposal, with their q and confidences."""
    return Proposal(proposal.token_ids[:n], proposal.q[:n] if proposal.q is not None else None,
                    proposal.confidence[:n] if proposal.confidence is not None else None)
