"""What SamplingParams mean: the warp from logits to the distribution a token is drawn from.

The server applies it to the target's logits to get p; drafters apply it to their own logits
before drawing, so q tends towards p. Order and tie rules follow transformers' warpers:
temperature, then top-k (ties at the k-th value kept), then top-p (smallest set whose mass
reaches top_p, at least one token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


# A device's drafter draws from a stream that must differ from the server's for one request seed.
DRAFTER_SEED_OFFSET = 0x5EED


def new_generator(sampling: Sampling, offset: int = 0) -> torch.Generator | None:
    """The random stream of one request: None when greedy; seeded with seed + offset when the
    request has a seed (so it repeats); otherwise seeded from the OS, so unseeded requests
    never share a stream. The one place sled makes a sampling generator."""
    if sampling.greedy:
        return None
    generator = torch.Generator()
    if sampling.seed is not None:
        generator.manual_seed((sampling.seed + offset) % 2**64)   # torch takes 64 bits
    else:
        generator.seed()
    return generator


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities to sample from, for sampling mode.

    logits: [..., vocab] -> probs: [..., vocab] in float32/64, rows sum to 1.
    """
    if sampling.greedy:
        raise ValueError("warp() is for sampling; greedy takes the argmax of the logits")
    scores = logits.to(torch.float64) / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - sampling.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)
