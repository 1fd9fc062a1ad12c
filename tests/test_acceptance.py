"""The acceptance math on synthetic distributions, in the style of vLLM's rejection sampler tests.

Greedy: the docstring example and the edges. Sampling: whatever q the draft came from, the emitted
tokens must follow p. We check that with the total-variation distance between the empirical
distribution of many independent rounds and p, which must shrink like 1/sqrt(n) and stay under a
bound of sqrt(V / n); broken samplers run through the same statistic land far above it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from verify_server.acceptance import (DraftQ, Outcome, Proposal, decide, verify_greedy,
                                      verify_greedy_tree, verify_sampling, verify_sampling_tree)
from verify_server.engines.base import StepLogits
from verify_server.warp import warp

F64 = torch.float64
COUNTS = (500, 4000, 32000)


# --- greedy ----------------------------------------------------------------------------------

def one_hot_logits(argmaxes: Sequence[int], vocab: int = 10) -> torch.Tensor:
    """Logits [len, vocab] with noise, whose row j has its maximum at argmaxes[j]."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(len(argmaxes), vocab, generator=gen, dtype=F64)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_greedy_docstring_example():
    outcome = verify_greedy(one_hot_logits([5, 9, 7, 2]), [5, 9, 4])
    assert outcome == Outcome(accepted=2, emitted=[5, 9, 7])


def test_greedy_all_accepted_adds_bonus_from_last_position():
    outcome = verify_greedy(one_hot_logits([5, 9, 4, 2]), [5, 9, 4])
    assert outcome.accepted == 3
    assert outcome.emitted == [5, 9, 4, 2]  # the bonus is argmax at position k


def test_greedy_first_token_rejected():
    outcome = verify_greedy(one_hot_logits([3, 9, 4, 2]), [5, 9, 4])
    assert outcome.accepted == 0
    assert outcome.emitted == [3]  # later matches do not count after a rejection


def test_greedy_accepts_a_prefix_only():
    # draft[1] mismatches, draft[2] matches: only the prefix before the mismatch is kept.
    outcome = verify_greedy(one_hot_logits([1, 2, 3, 4]), [1, 8, 3])
    assert outcome == Outcome(accepted=1, emitted=[1, 2])


# --- sampling: helpers -----------------------------------------------------------------------

def random_distribution(vocab: int, gen: torch.Generator, support: int | None = None,
                        must_include: Sequence[int] = ()) -> torch.Tensor:
    """A random distribution over `vocab`, zero outside a random support of the given size."""
    probs = torch.rand(vocab, generator=gen, dtype=F64) ** 3 + 0.02  # peaky, like an LM's
    if support is not None and support < vocab:
        keep = torch.randperm(vocab, generator=gen)[:support]
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[keep] = True
        mask[list(must_include)] = True
        probs = probs * mask
    return probs / probs.sum()


def random_p(k: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Target p: [k + 1, vocab], some rows with zeros (as after top-k / top-p warping)."""
    rows = [random_distribution(vocab, gen, support=vocab - 2 if j % 2 else None)
            for j in range(k + 1)]
    return torch.stack(rows)


def to_sparse(q: torch.Tensor) -> DraftQ:
    ids = q.nonzero().flatten()
    return DraftQ(ids=ids, probs=q[ids].to(F64))


def draw_drafts(dists: Sequence[torch.Tensor], n: int, gen: torch.Generator) -> list[list[int]]:
    """n independent drafts: position j drawn from dists[j] by torch.multinomial, as drafters do."""
    columns = [torch.multinomial(d, n, replacement=True, generator=gen) for d in dists]
    return torch.stack(columns, dim=1).tolist()


def total_variation(samples: Sequence[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(list(samples), dtype=torch.long), minlength=p.shape[-1])
    return 0.5 * float((counts.to(F64) / counts.sum() - p).abs().sum())


def bound(vocab: int, n: int) -> float:
    """Allowed TV for n samples: E[TV] <= sqrt(V / (2 pi n)) ~ 0.4 sqrt(V / n); 2.5x that."""
    return math.sqrt(vocab / n)


Verify = Callable[[torch.Tensor, Sequence[int], Sequence[DraftQ] | None, torch.Generator],
                  Outcome]


def run_rounds(verify: Verify, p: torch.Tensor, q_dense: Sequence[torch.Tensor] | None,
               draft_dists: Sequence[torch.Tensor], n: int, gen: torch.Generator) -> list[Outcome]:
    """n independent rounds, each with a fresh draft (and fresh uniforms inside verify)."""
    q = None if q_dense is None else [to_sparse(d) for d in q_dense]
    return [verify(p, draft, q, gen) for draft in draw_drafts(draft_dists, n, gen)]


def make_case(mode: str, vocab: int, k: int, seed: int):
    """(p, q_dense or None, the distributions drafts are drawn from)."""
    gen = torch.Generator().manual_seed(seed)
    p = random_p(k, vocab, gen)
    # Sparse: a few ids only, so q is far from p and both accept and reject paths matter.
    sparse = [random_distribution(vocab, gen, support=max(2, vocab // 3)) for _ in range(k)]
    if mode == "sparse-q":
        return p, sparse, sparse
    if mode == "deterministic":
        # The verifier sees no q (q = one-hot of the draft); the drafts come from elsewhere, here
        # half from p and half from the sparse guess, so acceptances are frequent enough to count.
        return p, None, [0.5 * p[j] + 0.5 * d for j, d in enumerate(sparse)]
    if mode == "deterministic-fixed":
        # Like an n-gram drafter on a fixed context: always the same draft (p's likeliest token).
        return p, None, [torch.nn.functional.one_hot(p[j].argmax(), vocab).to(F64)
                         for j in range(k)]
    raise ValueError(mode)


# --- sampling: the distribution of emitted tokens --------------------------------------------

@pytest.mark.parametrize("vocab,seed", [(8, 0), (16, 1)])
@pytest.mark.parametrize("mode", ["sparse-q", "deterministic", "deterministic-fixed"])
def test_first_emitted_token_follows_p(mode, vocab, seed):
    k = 2
    p, q, drafts_from = make_case(mode, vocab, k, seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    distances = []
    for n in COUNTS:
        outcomes = run_rounds(verify_sampling, p, q, drafts_from, n, gen)
        assert all(len(o.emitted) == o.accepted + 1 and 0 <= o.accepted <= k for o in outcomes)
        distances.append(total_variation([o.emitted[0] for o in outcomes], p[0]))

    # Every count within its bound, and the distance shrinks like 1/sqrt(n) (8x samples ~ /2.8).
    for n, d in zip(COUNTS, distances):
        assert d < bound(vocab, n), (n, distances)
    assert distances[0] > distances[1] > distances[2], distances
    assert distances[2] < distances[0] / 2, distances

    # The acceptance rate at position 0 is sum_x q(x) min(1, p(x)/q(x)) = sum min(p, q) (or
    # sum r(x) p(x) for a deterministic drafter drawing from r): within 4 sigma.
    r = drafts_from[0]
    expected = float(torch.minimum(p[0], r).sum()) if q is not None else float((r * p[0]).sum())
    rate = sum(o.accepted >= 1 for o in outcomes) / len(outcomes)
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / len(outcomes)) + 1e-9


@pytest.mark.parametrize("mode", ["sparse-q", "deterministic"])
@pytest.mark.parametrize("k", [1, 2])
def test_second_emitted_token_follows_p_given_first_accepted(mode, k):
    """k = 2: position 1 is draft[1] accepted or a correction; k = 1: it is the bonus token."""
    vocab, n = 12, 32000
    p, q, drafts_from = make_case(mode, vocab, k, seed=5)
    gen = torch.Generator().manual_seed(2000 + k)
    outcomes = run_rounds(verify_sampling, p, q, drafts_from, n, gen)
    second = [o.emitted[1] for o in outcomes if o.accepted >= 1]
    assert len(second) > n // 20  # enough conditional samples for the bound to mean something
    assert total_variation(second, p[1]) < bound(vocab, len(second))
    # Position 0 of the same rounds still follows p[0].
    assert total_variation([o.emitted[0] for o in outcomes], p[0]) < bound(vocab, n)


# --- the statistic has power: broken samplers fail it ----------------------------------------

def always_accept(p, draft, q, generator) -> Outcome:
    bonus = int(torch.multinomial(p[len(draft)], 1, generator=generator))
    return Outcome(len(draft), list(draft) + [bonus])


def resample_from_p_on_reject(p, draft, q, generator) -> Outcome:
    """Right acceptance test, wrong correction: draws from p instead of norm(max(0, p - q))."""
    for j, token in enumerate(draft):
        q_token = 1.0 if q is None else q[j].prob_of(token)
        if float(torch.rand((), generator=generator, dtype=F64)) * q_token < float(p[j, token]):
            continue
        return Outcome(j, list(draft[:j]) + [int(torch.multinomial(p[j], 1, generator=generator))])
    return always_accept(p, draft, q, generator)


@pytest.mark.parametrize("broken", [always_accept, resample_from_p_on_reject])
@pytest.mark.parametrize("mode", ["sparse-q", "deterministic-fixed"])
def test_distance_statistic_detects_a_wrong_sampler(mode, broken):
    vocab, n = 16, 16000
    p, q, drafts_from = make_case(mode, vocab, 1, seed=1)
    gen = torch.Generator().manual_seed(3000)
    wrong = total_variation([o.emitted[0] for o in run_rounds(broken, p, q, drafts_from, n, gen)],
                            p[0])
    right = total_variation(
        [o.emitted[0] for o in run_rounds(verify_sampling, p, q, drafts_from, n, gen)], p[0])
    assert right < bound(vocab, n)
    assert wrong > 3 * bound(vocab, n), (wrong, bound(vocab, n))


# --- reproducibility and the documented draw order -------------------------------------------

def test_same_seed_same_outcomes():
    vocab, k, n = 12, 4, 300
    p, q, drafts_from = make_case("sparse-q", vocab, k, seed=9)
    drafts = draw_drafts(drafts_from, n, torch.Generator().manual_seed(0))
    sparse = [to_sparse(d) for d in q]

    def run(seed: int) -> list[Outcome]:
        gen = torch.Generator().manual_seed(seed)
        return [verify_sampling(p, draft, sparse, gen) for draft in drafts]

    first = run(123)
    assert run(123) == first
    assert run(124) != first
    assert len({o.accepted for o in first}) > 1  # the rounds were not all trivially alike


def test_draw_order_one_uniform_per_examined_position_then_one_token():
    """Replaying the documented draws on a twin generator gives the same verdict and state."""
    vocab, k = 10, 3
    p, q, drafts_from = make_case("sparse-q", vocab, k, seed=11)
    sparse = [to_sparse(d) for d in q]
    gen = torch.Generator().manual_seed(42)
    twin = torch.Generator().manual_seed(42)
    for draft in draw_drafts(drafts_from, 200, torch.Generator().manual_seed(1)):
        outcome = verify_sampling(p, draft, sparse, gen)
        accepted = 0
        for j, token in enumerate(draft):
            u = float(torch.rand((), generator=twin, dtype=F64))
            if u * float(q[j][token]) >= float(p[j, token]):
                break
            accepted += 1
        assert outcome.accepted == accepted
        assert outcome.emitted[:accepted] == list(draft[:accepted])
        if accepted < k:
            dist = (p[accepted] - q[accepted]).clamp_min(0.0)
            assert float(dist[outcome.emitted[-1]]) > 0  # a correction comes from the residual
        else:
            dist = p[k]
        assert int(torch.multinomial(dist, 1, generator=twin)) == outcome.emitted[-1]
        assert torch.equal(gen.get_state(), twin.get_state())


# --- residual edge cases ---------------------------------------------------------------------

def test_p_equal_to_q_always_accepts():
    vocab, k = 12, 4
    gen = torch.Generator().manual_seed(3)
    p = torch.stack([random_distribution(vocab, gen, support=5) for _ in range(k + 1)])
    sparse = [to_sparse(p[j]) for j in range(k)]
    for draft in draw_drafts(list(p[:k]), 500, gen):
        outcome = verify_sampling(p, draft, sparse, gen)
        assert outcome.accepted == k
        assert float(p[k, outcome.emitted[-1]]) > 0


def test_p_equal_to_q_with_zero_listed_draft_token_falls_back_to_p():
    """q lists the draft token with probability 0 and equals p: the test rejects it, and the
    residual max(0, p - q) is all zeros; the correction must still be a valid token of p."""
    vocab = 8
    p = torch.tensor([[0.0, 0.5, 0.25, 0.25, 0, 0, 0, 0]] * 2, dtype=F64)
    q = DraftQ(ids=torch.tensor([0, 1, 2, 3]),
                probs=torch.tensor([0.0, 0.5, 0.25, 0.25], dtype=F64))
    gen = torch.Generator().manual_seed(0)
    corrections = []
    for _ in range(400):
        outcome = verify_sampling(p, [0], [q], gen)
        assert outcome.accepted == 0
        corrections.append(outcome.emitted[0])
    assert set(corrections) == {1, 2, 3}  # drawn from p itself
    assert total_variation(corrections, p[0]) < bound(vocab, len(corrections))


def test_p_and_q_equal_up_to_float32_rounding():
    """The wire carries q in float32: p and q differ by rounding only, which must never crash."""
    vocab, k = 16, 3
    gen = torch.Generator().manual_seed(4)
    p = torch.stack([random_distribution(vocab, gen, support=6) for _ in range(k + 1)])
    sparse = [DraftQ(ids=s.ids, probs=s.probs.float().to(F64)) for s in map(to_sparse, p[:k])]
    for draft in draw_drafts(list(p[:k]), 2000, gen):
        outcome = verify_sampling(p, draft, sparse, gen)
        assert len(outcome.emitted) == outcome.accepted + 1
        assert all(float(p[j, t]) > 0 for j, t in enumerate(outcome.emitted))


def test_deterministic_drafter_edge_cases():
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    sure = torch.zeros(2, vocab, dtype=F64)
    sure[:, 4] = 1.0
    # p puts all mass on the draft token: always accepted, bonus from p.
    assert all(verify_sampling(sure, [4], None, gen) == Outcome(1, [4, 4]) for _ in range(100))
    # p gives the draft token nothing: always rejected, the correction is p's only token.
    assert all(verify_sampling(sure, [3], None, gen) == Outcome(0, [4]) for _ in range(100))


# --- a whole step: decide -------------------------------------------------------------------------

class CountedLogits(StepLogits):
    """StepLogits that count how often the step's argmax is taken and copied to the host."""
    __slots__ = ("copies",)

    def targets(self) -> list[int]:
        self.copies += 1
        return StepLogits.targets(self)


def test_decide_gives_each_rows_own_verdict_from_one_argmax_copy():
    """One step of every row kind (a prefill chunk, greedy chain and tree, loose chain, a chain
    with SAT hints after every cut, sampling chain with q and tree): the verdicts are those of
    the per-row rules, sampling under the same seeded stream, and the step's argmax is taken
    and copied to the host once."""
    gen = torch.Generator().manual_seed(3)
    vocab, widths = 12, [4, 4, 5, 4, 4 + 4 * 2, 4, 5]
    packed = torch.randn(sum(widths[1:]), vocab, generator=gen)
    spans, offset = [None], 0
    for width in widths[1:]:
        spans.append(slice(offset, offset + width))
        offset += width
    row = [None] + [packed[span] for span in spans[1:]]
    greedy, warm = Sampling(), Sampling(temperature=0.8, top_k=6)   # unseeded: rejection sampling
    targets = [r.argmax(-1).tolist() if r is not None else None for r in row]
    chain = targets[1][:3]                           # accepted whole: the bonus follows
    tree_parents = (0, 1, 0, 3)
    tree = [targets[2][0] + 1, 7, targets[2][0], targets[2][3]]
    loose = Loose(window=1, entropy=0.0)             # keeps any mismatch the next token backs
    sat_draft = [targets[4][0], (targets[4][1] + 1) % vocab, 5]
    q = [to_sparse(random_distribution(vocab, gen, support=4)) for _ in range(3)]
    proposals = [None,
                 Proposal(chain, greedy),
                 Proposal(tree, greedy, parents=tree_parents),
                 Proposal([3, 3, 3], greedy, loose=loose),
                 Proposal(sat_draft, greedy, lookahead=2, every_cut=True),
                 Proposal([4, 5, 6], warm, torch.Generator().manual_seed(1), q=q),
                 Proposal([1, 2, 3, 4], warm, torch.Generator().manual_seed(2),
                          parents=tree_parents)]
    logits = CountedLogits(packed, spans)
    logits.copies = 0
    outcomes = decide(proposals, logits)
    assert logits.copies == 1 and outcomes[0] is None
    assert outcomes[1] == verify_greedy(row[1], chain) and outcomes[1].accepted == 3
    assert outcomes[2] == verify_greedy_tree(row[2], tree, tree_parents)
    assert outcomes[2].path == (3, 4)
    assert outcomes[3] == verify_greedy(row[3], [3, 3, 3], loose)
    sat = verify_greedy(row[4][:4], sat_draft)
    assert sat.accepted == 1
    first = 4 + sat.accepted * 2                     # the block after the accepted token
    assert outcomes[4].hints == targets[4][first:first + 2]
    assert outcomes[4].emitted == sat.emitted
    assert outcomes[5] == verify_sampling(warp(row[5], warm), [4, 5, 6], q,
                                          torch.Generator().manual_seed(1))
    assert outcomes[6] == verify_sampling_tree(warp(row[6], warm), [1, 2, 3, 4], tree_parents,
                                               torch.Generator().manual_seed(2))
