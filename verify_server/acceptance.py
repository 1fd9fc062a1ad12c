"""Acceptance math: which draft tokens the target keeps, and the one token it adds.

p is the target's distribution at each position, q the drafter's. Every function takes the
target output at len(draft) + 1 positions. For a chain, position j scores the token that follows
context + draft[:j], so the last position (after the whole draft) gives the bonus token. For a
tree (sled.wire.tree: one parent per draft token, 0 the root), position 0 follows the root and
position i follows node i, each node seeing its ancestors only.

Terms, used with these meanings everywhere in verify_server/:

    draft       the tokens a drafter proposes for one round (draft_len of them, at most
                max_draft_tokens), each drawn from q: a chain, or the nodes of a tree
    verified    how many draft tokens the target checked in a round: a count, len(draft) or
                fewer when the session's length limit leaves less room
    path        the accepted nodes of a tree, from the root down: the chain of children whose
                every token the target keeps (a chain's path is 1, 2, ..., accepted)
    accepted    how many draft tokens the target keeps: the length of the path, so for a chain
                always a prefix of the draft, for a tree one root-to-node branch of it
    correction  the target's own token after the path's last node, in place of every child
                it rejected there
    bonus       the target's token after a path that ends at a leaf (a fully accepted chain)
    emitted     the tokens a round adds to the output: the path's tokens + [correction or
                bonus], so one more than accepted (fewer when an end id or the length limit
                cuts them)

Example (greedy chain): draft = [5, 9, 4], argmax p = [5, 9, 7, 2]
  -> verified = 3; draft[0], draft[1] match, draft[2] = 4 != 7: accepted = 2,
     emitted = [5, 9, 7] (7 is the correction). Had draft[2] been 7: accepted = 3,
     emitted = [5, 9, 7, 2] (2 is the bonus).
Example (greedy tree): draft = [5, 9, 7, 4], parents = [0, 1, 0, 3] (root -> 5 -> 9,
  root -> 7 -> 4), argmax p after the root 7, after node 3 (the 7) 4, after node 4 2
  -> path (3, 4), accepted = 2, emitted = [7, 4, 2] (2 is the bonus: node 4 is a leaf).

Loose verification (opt-in per session, NOT lossless: sled.wire.loose) is the one exception to "the
output is the target's": verify_greedy may then keep a mismatching draft token (loose_accepted).

A step is decided in one call, `decide(proposals, logits)`: every row of the step (greedy and
sampling, chains and trees, SAT hints, loose), the greedy rows and every SAT hint from one argmax
over the step's logits and one copy of it to the host.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sled.wire.keyed import keyed_pick
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from sled.wire.tree import children
from verify_server.engines.base import StepLogits
from verify_server.warp import warp


@dataclass(frozen=True, slots=True)
class Outcome:
    accepted: int            # draft tokens kept: the path's length (a chain: a prefix of the draft)
    emitted: list[int]       # draft[:accepted] + [correction or bonus]
    hints: list[int] = field(default_factory=list)   # SAT guesses of the tokens after `emitted`
    # A tree draft: the accepted nodes, root's child first (node i = draft[i - 1]); () for a chain,
    # whose accepted nodes are 1..accepted
    path: tuple[int, ...] = ()
    # Loose: the draft positions kept although the target's argmax there was another token
    loose_at: tuple[int, ...] = ()


def loosely_kept(loose: Loose, logits: torch.Tensor, draft: Sequence[int],
                 targets: Sequence[int], j: int) -> bool:
    """Whether a loose session keeps the mismatching draft[j] (sled.wire.loose): the next window - 1
    draft tokens are the target's own and the target was unsure at j. logits [len(draft) + 1, vocab]."""
    after = range(j + 1, j + loose.window)
    if after.stop > len(draft) or any(draft[i] != targets[i] for i in after):
        return False
    return top3_entropy(logits[j]) > loose.entropy


def top3_entropy(logits: torch.Tensor) -> float:
    """Entropy in nats of the three most likely tokens of logits [vocab], renormalized."""
    top = torch.softmax(logits.to(torch.float64), dim=-1).topk(3).values
    top = top / top.sum()
    return float(-(top * top.clamp_min(1e-300).log()).sum())


@dataclass(frozen=True, slots=True)
class DraftQ:
    """q at one draft position as tensors, zero outside `ids` (probs sum to 1): the checked
    form of the wire's SparseDistribution."""
    ids: torch.Tensor        # [n] int64
    probs: torch.Tensor      # [n] float64

    def dense(self, vocab: int) -> torch.Tensor:  # [vocab]
        q = torch.zeros(vocab, dtype=torch.float64)
        q[self.ids] = self.probs
        return q

    def prob_of(self, token: int) -> float:
        hit = (self.ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if len(hit) else 0.0


def verify_greedy(logits: torch.Tensor, draft: Sequence[int], loose: Loose | None = None) -> Outcome:
    """logits: [draft_len + 1, vocab]. Accept while draft[j] == argmax p_j, then emit argmax p.
    With `loose`, a mismatch that loosely_kept() is accepted too (its position in loose_at).

    Loose example, window 2: draft [5, 8, 4], argmax p [5, 9, 4, 2], the target unsure at
    position 1 -> 8 is kept because the next draft token 4 is the target's own after it:
    accepted 3, emitted [5, 8, 4, 2], loose_at (1,)."""
    return greedy_chain(logits.argmax(dim=-1).tolist(), draft, loose, logits)


def greedy_chain(targets: Sequence[int], draft: Sequence[int], loose: Loose | None = None,
                 logits: torch.Tensor | None = None) -> Outcome:
    """verify_greedy given the argmax p at each position, `targets` [draft_len + 1]; `logits`
    only for a loose session (its entropy test)."""
    accepted, kept = 0, []
    while accepted < len(draft):
        if draft[accepted] != targets[accepted]:
            if loose is None or not loosely_kept(loose, logits, draft, targets, accepted):
                break
            kept.append(accepted)
        accepted += 1
    return Outcome(accepted, list(draft[:accepted]) + [targets[accepted]], loose_at=tuple(kept))


def verify_greedy_tree(logits: torch.Tensor, draft: Sequence[int],
                       parents: Sequence[int]) -> Outcome:
    """logits: [len(draft) + 1, vocab], row 0 after the root, row i after node i (draft[i - 1]).
    From the root, follow the child whose token is the target's argmax while there is one; emit
    the path, then argmax p after its last node.

    Example: draft [5, 9, 7, 4], parents [0, 1, 0, 3] (root -> 5 -> 9, root -> 7 -> 4), argmax p
    after root 7, after node 3 (the 7) 4, after node 4 2 -> path (3, 4), emitted [7, 4, 2].
    """
    return greedy_tree(logits.argmax(dim=-1).tolist(), draft, parents)


def greedy_tree(targets: Sequence[int], draft: Sequence[int], parents: Sequence[int]) -> Outcome:
    """verify_greedy_tree given the argmax p after the root and after each node, `targets`."""
    kids = children(parents)
    node, path = 0, []
    while True:
        child = next((c for c in kids[node] if draft[c - 1] == targets[node]), None)
        if child is None:
            break
        path.append(child)
        node = child
    return Outcome(len(path), [draft[c - 1] for c in path] + [targets[node]], path=tuple(path))


def verify_sampling_tree(
    p: torch.Tensor,                    # [len(draft) + 1, vocab] target probabilities (warped)
    draft: Sequence[int],               # the tree's tokens, each a deterministic candidate
    parents: Sequence[int],             # sled.wire.tree: node i's parent, 0 = the root
    generator: torch.Generator,
) -> Outcome:
    """Recursive rejection sampling over a tree of deterministic candidates (q one-hot at each):
    exact for any tree. At a node, its children are tried in order: a child's token x is accepted
    with probability r(x) / sum(r), where r starts as p at the node and loses the token of every
    rejected child; the first accepted child is the next node. When none is accepted (or the node
    is a leaf) the last token is drawn from r (p itself at a leaf: the bonus).

    Each token y comes out with probability p(y): a candidate x1 with p(x1), else x2 with
    (1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2), and so on; the correction from what is left. A chain
    decides exactly as verify_sampling with q None, drawing the same numbers. Draw order: one
    uniform per child tried, then one token.
    """
    p = p.to(torch.float64)
    kids = children(parents)
    node, path = 0, []
    while True:
        residual = p[node].clone()
        child = None
        for c in kids[node]:
            token = draft[c - 1]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(residual.sum()) < float(residual[token]):
                child = c
                break
            residual[token] = 0.0
        if child is None:
            if float(residual.sum()) <= 0.0:   # the candidates held all of p up to rounding
                residual = p[node]
            last = int(torch.multinomial(residual, 1, generator=generator))
            return Outcome(len(path), [draft[c - 1] for c in path] + [last], path=tuple(path))
        path.append(child)
        node = child


def verify_sampling(
    p: torch.Tensor,                    # [draft_len + 1, vocab] target probabilities (warped)
    draft: Sequence[int],               # [draft_len]
    q: Sequence[DraftQ] | None,         # [draft_len], or None for a deterministic drafter
    generator: torch.Generator,
) -> Outcome:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.), exact for any q.

    Accept draft[j] with probability min(1, p(x)/q(x)); on the first rejection draw the
    correction from normalize(max(0, p - q)); if the whole draft is accepted draw the bonus
    token from p at the position after it.
    A deterministic drafter has q = one-hot(x), so acceptance is p(x) and the residual is p
    with x removed. Draw order per round: one uniform per examined position, then one token.
    """
    p = p.to(torch.float64)
    vocab = p.shape[-1]
    for j, token in enumerate(draft):
        q_token = 1.0 if q is None else q[j].prob_of(token)
        p_token = float(p[j, token])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * q_token < p_token:  # u < p/q without dividing
            continue
        if q is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - q[j].dense(vocab)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p[j]
        correction = int(torch.multinomial(residual, 1, generator=generator))
        return Outcome(j, list(draft[:j]) + [correction])
    bonus = int(torch.multinomial(p[len(draft)], 1, generator=generator))
    return Outcome(len(draft), list(draft) + [bonus])


def keyed_targets(p: torch.Tensor, seed: int, positions: Sequence[int]) -> list[int]:
    """The token the keyed rule (sled.wire.keyed) picks at each row of p [rows, vocab] (warped
    target probabilities), row i being sequence position positions[i]: a seeded request's
    tokens, fixed by its seed and their positions. Verifying a draft against them is greedy
    verification (greedy_chain, greedy_tree), and each is an exact draw from its row of p."""
    # p copied to the host whole, once: on a CPU that is 3x (top-k 50) and 1.4x (the whole
    # vocabulary) faster than gathering each row's support first (BENCHMARKS.md, keyed sampling)
    rows = p.to(torch.float64).cpu().numpy()
    picked = []
    for row, position in zip(rows, positions):
        ids = np.flatnonzero(row > 0)
        picked.append(keyed_pick(ids, row[ids], seed, position))
    return picked


def tree_positions(parents: Sequence[int], first: int) -> list[int]:
    """The sequence position each node of a tree predicts (node 0, the root, predicts FIRST; a
    node one deeper than its parent predicts one further)."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return [first + d for d in depth]


# --- a whole step ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Proposal:
    """What deciding one row of a step takes: its draft, and the session's way of judging it."""
    draft: Sequence[int]                # [draft_len], a chain or a tree's nodes
    sampling: Sampling                  # greedy, or how p is warped before sampling
    generator: torch.Generator | None = None   # the session's random stream (sampling)
    q: Sequence[DraftQ] | None = None   # [draft_len] a sampling chain's q; None: deterministic
    parents: Sequence[int] = ()         # a tree draft's parent indices; (): a chain
    loose: Loose | None = None          # opt-in loose verification (greedy chains)
    lookahead: int = 0                  # m SAT slots per block after the draft
    every_cut: bool = False             # a SAT block after every place the draft may be cut
    position: int | None = None         # the sequence position the row's first logits predict
                                        # (a seeded sampling row needs it: sled.wire.keyed)


def decide(proposals: Sequence[Proposal | None], logits: StepLogits) -> list[Outcome | None]:
    """Every row of a step, decided from the step's logits (row b's: logits.row(b),
    [draft_len + 1 + blocks * m, vocab]); None for a row without a proposal (a prefill chunk).

    The greedy rows and every SAT hint read the argmax of the step's logits, taken once and
    copied to the host once; a sampling row warps its own logits into p and draws from its
    session's stream, in row order."""
    targets: list[int] | None = None
    outcomes: list[Outcome | None] = []
    for b, proposal in enumerate(proposals):
        span = logits.spans[b]
        if proposal is None or span is None:
            outcomes.append(None)
            continue
        if targets is None and (proposal.sampling.greedy or proposal.lookahead):
            targets = logits.targets()
        row_targets = targets[span] if targets is not None else []
        outcomes.append(_decide_row(proposal, row_targets, logits.row(b)))
    return outcomes


def _decide_row(proposal: Proposal, targets: list[int], logits: torch.Tensor) -> Outcome:
    """One row: its path and token, then its SAT hints (from the block that follows the accepted
    tokens with every_cut, else from the one block when the whole draft survived)."""
    draft, sampling, draft_len = proposal.draft, proposal.sampling, len(proposal.draft)
    keyed = not sampling.greedy and sampling.seed is not None     # sled.wire.keyed
    if keyed and proposal.position is None:
        raise ValueError("a seeded sampling row is decided by its positions: give "
                         "Proposal.position")
    if proposal.parents:        # deterministic candidates only (validation.check_tree)
        if sampling.greedy:
            return greedy_tree(targets, draft, proposal.parents)
        p = warp(logits.float(), sampling)
        if keyed:
            picked = keyed_targets(p, sampling.seed,
                                   tree_positions(proposal.parents, proposal.position))
            return greedy_tree(picked, draft, proposal.parents)
        return verify_sampling_tree(p, draft, proposal.parents, proposal.generator)
    if sampling.greedy:
        outcome = greedy_chain(targets[:draft_len + 1], draft, proposal.loose, logits)
    else:
        p = warp(logits[:draft_len + 1].float(), sampling)      # [draft_len + 1, vocab]
        first = proposal.position
        outcome = (greedy_chain(keyed_targets(p, sampling.seed, range(first, first + len(p))),
                                draft) if keyed
                   else verify_sampling(p, draft, proposal.q, proposal.generator))
    m = proposal.lookahead
    if m and (proposal.every_cut or outcome.accepted == draft_len):
        # SAT slot 1 stands for the correction or bonus token; each slot guesses the token
        # after its own.
        first = draft_len + 1 + (outcome.accepted if proposal.every_cut else 0) * m
        hints = targets[first:first + m]
        if keyed:       # a seeded session's guesses by its own rule, at the positions they guess
            after = proposal.position + len(outcome.emitted)
            hints = keyed_targets(warp(logits[first:first + m].float(), sampling),
                                  sampling.seed, range(after, after + m))
        outcome = replace(outcome, hints=hints)
    return outcome
