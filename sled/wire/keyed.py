"""Keyed sampling: a seeded request's token at each position is fixed by the seed and the
position, whoever drafts it, whoever decodes it, however its rounds are cut.

The token at position n (its index in the whole sequence, prompt included) is

    argmax over v of  log p_n(v) + g(seed, n, v)

where p_n is the target's warped distribution there (sled.wire.sampling.warp) and g(seed, n, v)
is a standard Gumbel number made from a hash of (seed, n, v). That is an exact draw from p_n (the
Gumbel-max trick), and the numbers at different positions are independent, so the sequence
follows the target's distribution exactly; yet it is a function of the seed alone. Verifying a
draft is then greedy verification on the perturbed scores: a draft token is kept while it is the
one the rule picks, and the first one that is not is replaced by it. The device's drafter, picking
its own tokens by the same rule from its q (argmax of log q_n(v) + g(seed, n, v)), agrees with the
target wherever q is close to p.

So a seeded request gives the same tokens on the device's drafts, the server's SAT drafts, plain
decoding, any draft length and any sequence of moves between them (verify_server.placement).

The hash is splitmix64's finalizer over 64-bit words: a key from (seed, n), then one word per
token id; its top 52 bits k make u = (k + 1/2) / 2^52, strictly inside (0, 1) and exact in
float64, and g = -log(-log u). This module is the one
home of it: numpy here, and the server reads the same numbers through it.
"""
from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15          # 2^64 / the golden ratio: splitmix64's step
SEED_SALT = 0x5D588B656C078965       # keeps seed 0, position 0 away from the all-zero word


def _mix(z: int) -> int:
    """splitmix64's finalizer on one 64-bit word (Python ints)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _mix_words(z: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of one position of one seeded request."""
    key = _mix((seed * GOLDEN + SEED_SALT) & MASK)
    return _mix((key + (position + 1) * GOLDEN) & MASK)


def gumbel(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """g(seed, position, v) for each token id v in IDS: standard Gumbel numbers, float64."""
    words = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        z = _mix_words(np.uint64(position_key(seed, position)) + words * np.uint64(GOLDEN))
    u = ((z >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0 ** -52     # exact, inside (0, 1)
    return -np.log(-np.log(u))


def keyed_pick(ids: np.ndarray, probs: np.ndarray, seed: int, position: int) -> int:
    """The id the rule picks at POSITION among IDS with probabilities PROBS (> 0)."""
    ids = np.asarray(ids)
    scores = np.log(np.asarray(probs, dtype=np.float64)) + gumbel(seed, position, ids)
    return int(ids[int(np.argmax(scores))])
