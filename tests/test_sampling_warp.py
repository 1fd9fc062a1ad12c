"""The device's numpy sampling (sled.wire.sampling, drafters.base.choose_token) against the server's
torch twin (verify_server.warp): the same warped distribution, the same support, the same rules
for ties, and random streams that repeat exactly when seeded."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from drafters.base import SparseQ, choose_token, token_confidence
from sled.wire.sampling import DRAFTER_SEED_OFFSET, Sampling, new_generator, warp
from verify_server import warp as server

TEMPERATURES = (0.05, 0.3, 0.7, 1.0, 1.8, 5.0)
TOP_PS = (1.0, 0.999999, 0.95, 0.8, 0.5, 0.3, 0.1, 1e-9, 0.0)
SHAPES = ((2,), (7,), (16,), (3, 16), (50,), (4, 50), (257,), (2, 1000), (32_000,))


def top_ks(vocab: int) -> tuple[int, ...]:
    return tuple(sorted({0, 1, 2, 5, vocab // 3, vocab - 1, vocab, vocab + 7}))


def both(logits: np.ndarray, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """(device q warp, server p warp) of the same logits, both as float64 numpy."""
    return warp(logits, sampling), server.warp(torch.from_numpy(logits), sampling).numpy()


def assert_same(got: np.ndarray, want: np.ndarray, label: str) -> None:
    assert got.dtype == np.float64 and got.shape == want.shape, label
    assert np.array_equal(got > 0, want > 0), f"{label}: support differs"
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15, err_msg=label)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_warp_equals_torch_warp_on_random_logits(shape):
    rng = np.random.default_rng(sum(shape))
    for temperature, top_k, top_p in itertools.product(TEMPERATURES, top_ks(shape[-1]), TOP_PS):
        logits = rng.normal(size=shape) * rng.choice([0.5, 3.0, 20.0])
        sampling = Sampling(temperature, top_k, top_p)
        assert_same(*both(logits, sampling), f"{shape} {sampling}")


@pytest.mark.parametrize("vocab", [2, 3, 5, 8, 11, 16])
def test_numpy_warp_equals_torch_warp_with_tied_logits(vocab):
    """Few distinct values, so the k-th value and the top-p boundary are often tied. torch sorts
    rows of up to 16 stably, as the numpy warp does: the supports agree id for id."""
    rng = np.random.default_rng(vocab)
    for temperature, top_k, top_p in itertools.product(TEMPERATURES, top_ks(vocab), TOP_PS):
        for _ in range(4):
            logits = rng.integers(-2, 3, size=(3, vocab)).astype(np.float32)
            sampling = Sampling(temperature, top_k, top_p)
            assert_same(*both(logits, sampling), f"{logits.tolist()} {sampling}")


@pytest.mark.parametrize("vocab", [17, 50, 1000])
def test_top_k_ties_agree_on_any_vocab(vocab):
    rng = np.random.default_rng(vocab)
    for temperature, top_k in itertools.product(TEMPERATURES, top_ks(vocab)):
        logits = rng.integers(-3, 4, size=(4, vocab)).astype(np.float32)
        sampling = Sampling(temperature, top_k)
        assert_same(*both(logits, sampling), f"{sampling}")


@pytest.mark.parametrize("vocab", [17, 50, 1000])
def test_top_p_ties_on_longer_rows_differ_at_most_in_which_tied_ids(vocab):
    """On rows longer than 16 torch's sort puts tied scores in no set order, so where a tie
    straddles the top-p boundary it may keep other ids of that tie than the numpy warp (which
    drops the lower ids first). The same probabilities, the same number of ids, the same ids
    everywhere else."""
    rng = np.random.default_rng(vocab)
    for temperature, top_k, top_p in itertools.product(TEMPERATURES, top_ks(vocab), TOP_PS):
        logits = rng.integers(-3, 4, size=(4, vocab)).astype(np.float32)
        got, want = both(logits, Sampling(temperature, top_k, top_p))
        np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-9, atol=1e-15)
        for row, g, w in zip(logits, got, want):
            assert (g > 0).sum() == (w > 0).sum()
            differ = np.flatnonzero((g > 0) != (w > 0))
            boundary = row[g > 0].min()      # the least likely kept score
            assert (row[differ] == boundary).all()
            tied = np.flatnonzero(row == boundary)
            kept = tied[g[tied] > 0]
            assert (kept == tied[len(tied) - len(kept):]).all()  # the highest ids of the tie


def test_top_k_keeps_ties_at_the_kth_value():
    probs = warp(np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0]), Sampling(1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, True, False, False]


def test_top_p_drops_the_lower_ids_of_a_tie_first():
    """Four equal scores, top_p 0.5: two of them make the mass; the last two ids stay."""
    probs = warp(np.zeros(4), Sampling(1.0, top_p=0.5))
    assert (probs > 0).tolist() == [False, False, True, True]
    probs = warp(np.zeros(4), Sampling(1.0, top_p=0.0))
    assert (probs > 0).tolist() == [False, False, False, True]   # one token at least


def test_truncation_actually_happens():
    """Guards the comparisons above against two no-ops."""
    logits = np.random.default_rng(0).normal(size=(8, 50)) * 3
    assert ((warp(logits, Sampling(1.0, top_k=5)) > 0).sum(-1) == 5).all()
    assert ((warp(logits, Sampling(1.0, top_p=0.5)) > 0).sum(-1) < 50).all()
    assert ((warp(logits, Sampling(1.0, top_p=0.0)) > 0).sum(-1) == 1).all()
    e = np.exp((logits - logits.max(-1, keepdims=True)) / 0.5)
    np.testing.assert_allclose(warp(logits, Sampling(0.5)), e / e.sum(-1, keepdims=True), rtol=1e-12)


def test_warp_refuses_greedy():
    with pytest.raises(ValueError):
        warp(np.zeros(4), Sampling(0.0))


def draws(generator: np.random.Generator | None, n: int = 8) -> list[float]:
    return generator.random(n).tolist()


def test_new_generator_repeats_when_seeded_and_differs_otherwise():
    assert new_generator(Sampling(0.0, seed=3)) is None      # greedy draws nothing
    seeded = Sampling(0.8, seed=3)
    assert isinstance(new_generator(seeded), np.random.Generator)
    assert draws(new_generator(seeded)) == draws(new_generator(seeded))
    assert draws(new_generator(seeded, DRAFTER_SEED_OFFSET)) == draws(new_generator(seeded, DRAFTER_SEED_OFFSET))
    assert draws(new_generator(seeded)) != draws(new_generator(Sampling(0.8, seed=4)))
    assert draws(new_generator(seeded)) != draws(new_generator(seeded, DRAFTER_SEED_OFFSET))
    assert draws(new_generator(Sampling(0.8))) != draws(new_generator(Sampling(0.8)))


def test_new_generator_seed_plus_offset_wraps_at_64_bits():
    top = Sampling(0.8, seed=2**64 - 1)
    assert draws(new_generator(top, offset=2)) == draws(new_generator(Sampling(0.8, seed=1)))
    assert draws(new_generator(top, offset=2)) == draws(np.random.default_rng(1))


def frequencies(logits: np.ndarray, sampling: Sampling, q_support: int, n: int, seed: int):
    """The q of choose_token and how often each of its ids came out of n draws."""
    generator = np.random.default_rng(seed)
    counts: dict[int, int] = {}
    q = None
    for _ in range(n):
        token, drawn_from = choose_token(logits, sampling, q_support, generator)
        assert q is None or drawn_from == q       # the same logits: the same q every time
        q = drawn_from
        counts[token] = counts.get(token, 0) + 1
    return q, counts


@pytest.mark.parametrize("sampling, q_support", [
    (Sampling(0.9, top_k=20, top_p=0.9), 8),
    (Sampling(1.3), 32),
    (Sampling(0.7, top_p=0.6), 32),
    (Sampling(1.0, top_k=3), 32),
])
def test_choose_token_draws_follow_its_q(sampling, q_support):
    logits = np.random.default_rng(5).normal(size=300).astype(np.float32) * 2
    n = 20_000
    q, counts = frequencies(logits, sampling, q_support, n, seed=11)
    assert set(counts) <= set(q.ids) and len(q.ids) <= q_support
    assert sum(q.probs) == pytest.approx(1.0, abs=1e-12)
    # q is the warp truncated to its most likely ids, renormalised; the server's p has them all.
    p = warp(logits, sampling)
    assert sorted(q.ids) == sorted(np.argsort(-p, kind="stable")[:len(q.ids)].tolist())
    np.testing.assert_allclose(q.probs, p[q.ids] / p[q.ids].sum(), rtol=1e-12)
    assert (server.warp(torch.from_numpy(logits), sampling).numpy()[q.ids] > 0).all()
    # Pearson's chi-square of the counts against n * q: far below its 0.9999 quantile
    # (< df + 10 sqrt(df) + 15 for these df) for a draw that follows q.
    expected = n * np.asarray(q.probs)
    observed = np.array([counts.get(i, 0) for i in q.ids])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = len(q.ids) - 1
    assert chi2 < df + 10 * df ** 0.5 + 15, (chi2, df)


def test_choose_token_chi_square_catches_a_wrong_q():
    """The check above has teeth: counts drawn from the untruncated warp fail it against a q
    truncated to 2 ids of a flat distribution."""
    logits = np.zeros(10, dtype=np.float32)
    q, _ = frequencies(logits, Sampling(1.0), 2, 1, seed=0)
    wrong = np.random.default_rng(0).choice(10, size=2000)
    observed = np.array([(wrong == i).sum() for i in q.ids])
    expected = 2000 * np.asarray(q.probs)
    assert ((observed - expected) ** 2 / expected).sum() > 1 + 10 + 15


def test_choose_token_repeats_with_a_seeded_generator():
    logits = np.random.default_rng(2).normal(size=500).astype(np.float32)
    sampling = Sampling(0.8, top_p=0.95, seed=9)
    runs = []
    for _ in range(2):
        generator = new_generator(sampling, DRAFTER_SEED_OFFSET)
        runs.append([choose_token(logits, sampling, 32, generator) for _ in range(50)])
    assert runs[0] == runs[1]
    assert len({token for token, _ in runs[0]}) > 1       # it does draw, not pick one


def test_choose_token_greedy_and_unseeded():
    logits = np.array([0.5, 2.0, 2.0, -1.0], dtype=np.float32)
    assert choose_token(logits, Sampling(0.0), 32) == (1, None)  # ties: the first, as torch
    token, q = choose_token(logits, Sampling(1.0), 32)          # no generator: from the OS
    assert token in q.ids and isinstance(q, SparseQ)
    assert all(isinstance(i, int) for i in q.ids) and all(isinstance(p, float) for p in q.probs)


def test_token_confidence():
    logits = np.array([1.0, 3.0, 0.0, 2.0], dtype=np.float32)
    softmax = np.exp(logits.astype(np.float64) - 3.0)
    assert token_confidence(logits, 1, None) == pytest.approx(1 / softmax.sum(), rel=1e-12)
    q = SparseQ([3, 1], [0.25, 0.75])
    assert token_confidence(logits, 1, q) == 0.75
    assert token_confidence(logits, 3, q) == 0.25
