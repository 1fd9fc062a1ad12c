"""What SamplingParams mean: the warp from logits to the distribution a token is drawn from.

Drafters apply it (numpy, here) to their own logits before drawing, so q tends towards p; the
server applies its torch twin (verify_server.warp) to the target's logits to get p. Order and
tie rules follow transformers' warpers: temperature, then top-k (ties at the k-th value kept),
then top-p (smallest set whose mass reaches top_p, at least one token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each check is written to pass only for good values.
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1] (finite), got {self.top_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, msg) -> "Sampling":
        """From a sled.v1.SamplingParams; top_p 0 means off, like 1 (a negative or NaN top_p is
        refused, not taken for 0)."""
        return cls(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
            seed=int(msg.seed) if msg.HasField("seed") else None,
        )

    def to_proto(self, msg) -> None:
        msg.temperature = self.temperature
        msg.top_k = self.top_k
        msg.top_p = self.top_p
        if self.seed is not None:
            msg.seed = self.seed


# A device's drafter that samples by its own draws takes a stream apart from the request's seed
# (the model drafters pick a seeded session's tokens by sled.wire.keyed instead).
DRAFTER_SEED_OFFSET = 0x5EED


def new_generator(sampling: Sampling, offset: int = 0) -> np.random.Generator | None:
    """The device's random stream of one request: None when greedy; seeded with seed + offset
    when the request has a seed (so it repeats); otherwise seeded from the OS, so unseeded
    requests never share a stream. The one place the device makes a sampling generator (the
    server's twin, a torch.Generator, is verify_server.warp.new_generator)."""
    if sampling.greedy:
        return None
    if sampling.seed is not None:
        return np.random.default_rng((sampling.seed + offset) % 2**64)
    return np.random.default_rng()


def warp(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Probabilities to sample from, for sampling mode.

    logits: [..., vocab] -> probs: [..., vocab] float64, rows sum to 1. The same steps as the
    server's torch warp (verify_server.warp), so a drafter's q follows the rules p follows.
    """
    if sampling.greedy:
        raise ValueError("warp() is for sampling; greedy takes the argmax of the logits")
    scores = np.asarray(logits, dtype=np.float64) / sampling.temperature   # [..., vocab]
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = np.partition(scores, vocab - sampling.top_k, axis=-1)[..., vocab - sampling.top_k, None]
        scores = np.where(scores < kth, -np.inf, scores)      # ties at the k-th value stay
    if sampling.top_p < 1.0:
        scores = np.where(_outside_nucleus(scores, sampling.top_p), -np.inf, scores)
    return _softmax(scores)


def _outside_nucleus(scores: np.ndarray, top_p: float) -> np.ndarray:
    """[..., vocab] True where top-p drops a token: in ascending order, those whose cumulative
    mass is <= 1 - top_p, never the most likely. Tied scores go in id order (a stable sort), as
    torch's sort orders them on rows of up to 16 and whenever it sorts stably."""
    order = np.argsort(scores, axis=-1, kind="stable")                   # [..., vocab] ascending
    cumulative = np.cumsum(_softmax(np.take_along_axis(scores, order, axis=-1)), axis=-1)
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1] = False  # always keep the most likely token
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return remove


def _softmax(scores: np.ndarray) -> np.ndarray:
    """softmax over the last axis, computed as torch computes it: exp(x - max) * (1 / sum)."""
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted * (1.0 / shifted.sum(axis=-1, keepdims=True))
