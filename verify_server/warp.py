"""The server's sampling warp and random stream, on torch: the twin of sled.wire.sampling's numpy
warp and new_generator, which the device uses.

The target's p comes from this warp; a drafter's q from the numpy one. Both take the same steps
in the same order (temperature, top-k keeping ties at the k-th value, top-p keeping the most
likely token), and tests hold them equal (tests/test_sampling_warp.py). This one matches
transformers' warpers exactly (tests/test_warp.py).
"""
from __future__ import annotations

import torch

from sled.wire.sampling import Sampling


def new_generator(sampling: Sampling, offset: int = 0) -> torch.Generator | None:
    """The random stream of one request: None when greedy; seeded with seed + offset when the
    request has a seed (so it repeats); otherwise seeded from the OS, so unseeded requests
    never share a stream. The one place the server makes a sampling generator."""
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
