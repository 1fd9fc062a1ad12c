"""verify_server.warp: the server's warp() is exactly transformers' temperature -> top-k -> top-p
warpers + softmax, and Sampling validates its fields and reads the wire message the way the proto
documents. (The device's numpy warp is held to this one in test_sampling_warp.py.)"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from verify_server.warp import warp

VOCAB = 50
TEMPERATURES = (0.3, 0.7, 1.0, 1.8)
TOP_KS = (0, 1, 5, 20, VOCAB - 1, VOCAB, VOCAB + 10)
TOP_PS = (1.0, 0.95, 0.8, 0.5, 0.1, 0.0)


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' generate() samples from: warpers in its order, then softmax.
    Like generate(), it leaves out top-k when top_k == 0 and top-p when top_p == 1."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k != 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return warpers(ids, logits.to(torch.float64)).softmax(dim=-1)


def random_logits(seed: int, rows: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 3.0


def tied_logits(seed: int, rows: int = 16) -> torch.Tensor:
    """Few distinct values, so the k-th value and the top-p boundary are often tied."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (rows, VOCAB), generator=gen).to(torch.float32)


@pytest.mark.parametrize("make_logits", [random_logits, tied_logits])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_warp_matches_transformers_warpers(make_logits, temperature):
    for i, (top_k, top_p) in enumerate(itertools.product(TOP_KS, TOP_PS)):
        logits = make_logits(i)
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        got = warp(logits, sampling)
        want = reference(logits, temperature, top_k, top_p)
        label = f"T={temperature} top_k={top_k} top_p={top_p}"
        assert got.shape == logits.shape
        # Same support exactly (the truncation rules), then the same probabilities.
        assert torch.equal(got > 0, want > 0), label
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=label)
        torch.testing.assert_close(got.sum(-1), torch.ones(len(got), dtype=got.dtype))


def test_truncation_actually_happens():
    """Guards the grid above against comparing two no-ops."""
    logits = random_logits(0)
    assert (warp(logits, Sampling(1.0, top_k=5)) > 0).sum(-1).eq(5).all()
    nucleus = warp(logits, Sampling(1.0, top_p=0.5))
    assert ((nucleus > 0).sum(-1) < VOCAB).all()
    assert (warp(logits, Sampling(1.0, top_p=0.0)) > 0).sum(-1).eq(1).all()  # argmax only
    # Off means off: top_k = 0 and top_p = 1 leave plain softmax(logits / T).
    torch.testing.assert_close(warp(logits, Sampling(0.5)),
                               (logits.double() / 0.5).softmax(-1), rtol=1e-12, atol=0)


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    probs = warp(logits, Sampling(1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, True, False, False]


def test_warp_single_position_and_greedy_rejected():
    logits = random_logits(1)[0]
    got = warp(logits, Sampling(0.9, top_k=10, top_p=0.9))
    want = reference(logits[None], 0.9, 10, 0.9)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError):
        warp(logits, Sampling(0.0))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5),
    dict(temperature=-1e-9),
    dict(temperature=math.nan),
    dict(temperature=1.0, top_k=-1),
    dict(temperature=1.0, top_p=1.01),
    dict(temperature=1.0, top_p=-0.1),
])
def test_sampling_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)


def test_sampling_accepts_the_edges():
    assert Sampling(temperature=0.0).greedy
    assert not Sampling(temperature=1e-3).greedy
    Sampling(temperature=1.0, top_k=0, top_p=0.0)
    Sampling(temperature=1.0, top_k=10 ** 6, top_p=1.0)


def test_from_proto_top_p_zero_means_off():
    assert Sampling.from_proto(pb.SamplingParams(temperature=0.7, top_p=0.0)).top_p == 1.0
    assert Sampling.from_proto(pb.SamplingParams(temperature=0.7)).top_p == 1.0  # unset is 0
    assert Sampling.from_proto(pb.SamplingParams(temperature=0.7, top_p=0.5)).top_p == 0.5


def test_from_proto_reads_seed_presence():
    msg = pb.SamplingParams(temperature=0.7, top_k=12, top_p=0.9)
    assert Sampling.from_proto(msg).seed is None
    msg.seed = 0  # present but zero: a real seed, not "no seed"
    assert Sampling.from_proto(msg).seed == 0
    msg.seed = 2 ** 63 + 5
    assert Sampling.from_proto(msg).seed == 2 ** 63 + 5


def test_from_proto_fields_and_round_trip():
    msg = pb.SamplingParams(temperature=0.7, top_k=12, top_p=0.9, seed=42)
    sampling = Sampling.from_proto(msg)
    assert sampling.temperature == pytest.approx(0.7, abs=1e-6)  # float32 on the wire
    assert (sampling.top_k, sampling.seed) == (12, 42)
    assert sampling.top_p == pytest.approx(0.9, abs=1e-6)
    out = pb.SamplingParams()
    sampling.to_proto(out)
    assert Sampling.from_proto(out) == sampling
    unseeded = pb.SamplingParams()
    Sampling(temperature=1.0).to_proto(unseeded)
    assert not unseeded.HasField("seed")
    assert Sampling.from_proto(pb.SamplingParams()).greedy  # default message = greedy
