"""Drafters: the n-gram drafter's lookup rules, the HF drafter's proposals and KV-cache rollback
(against a fresh drafter and a no-cache greedy oracle), and tokenizer fingerprints."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from conftest import assert_same_proposal, assert_valid_q

from drafters import load_drafter
from drafters.base import Drafter, Proposal, common_prefix
from drafters.hf import HFDrafter
from drafters.ngram import NgramDrafter
from sled.wire.fingerprint import fingerprint_tokenizer, fingerprint_vocab, short
from sled.wire.sampling import Sampling
from lab.tiny import make_tokenizer, save_pair

GREEDY = Sampling()
SAMPLING = Sampling(temperature=0.9, top_k=50, top_p=0.95)
LONG_TEXT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"


# --- n-gram ----------------------------------------------------------------------------------

def test_ngram_docstring_example():
    proposal = NgramDrafter().propose([7, 1, 2, 3, 9, 1, 2], 4, GREEDY)
    assert proposal == Proposal([3, 9, 1, 2], None)
    # Past the end of the match it keeps looking up the context it has extended itself.
    assert NgramDrafter().propose([7, 1, 2, 3, 9, 1, 2], 6, GREEDY).token_ids == [3, 9, 1, 2, 3, 9]


def test_ngram_prefers_the_longest_ngram():
    # [1, 2] last occurred at 0 (then 7); the shorter [2] last occurred at 4 (then 9).
    context = [1, 2, 7, 3, 2, 9, 1, 2]
    assert NgramDrafter(max_ngram=3).propose(context, 1, GREEDY).token_ids == [7]
    assert NgramDrafter(max_ngram=1).propose(context, 1, GREEDY).token_ids == [9]


def test_ngram_takes_the_latest_occurrence():
    assert NgramDrafter().propose([4, 5, 4, 6, 4], 2, GREEDY).token_ids == [6, 4]


@pytest.mark.parametrize("context", [[5], [1, 2, 3], [9, 9], [3, 1, 4, 1, 5, 9, 2, 6]])
@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_ngram_always_proposes_exactly_k(context, k):
    proposal = NgramDrafter().propose(context, k, SAMPLING)
    assert len(proposal.token_ids) == k
    assert proposal.q is None  # deterministic in every mode: q = one-hot


def test_ngram_without_a_match_repeats_the_last_token():
    assert NgramDrafter().propose([1, 2, 3], 4, GREEDY).token_ids == [3, 3, 3, 3]
    assert NgramDrafter().propose([5], 3, GREEDY).token_ids == [5, 5, 5]


def test_ngram_random_contexts_give_k_tokens_from_the_context():
    rng = random.Random(0)
    drafter = NgramDrafter(max_ngram=4)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        k = rng.randrange(1, 12)
        tokens = drafter.propose(context, k, GREEDY).token_ids
        assert len(tokens) == k
        assert set(tokens) <= set(context)
    drafter.rollback(0)  # stateless: a no-op that must not fail


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=0)
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=3)


def test_load_drafter_ngram_specs():
    default = load_drafter("ngram")
    assert isinstance(default, NgramDrafter) and default.max_ngram == 3
    two = load_drafter("ngram:2")
    assert isinstance(two, NgramDrafter) and two.max_ngram == 2 and two.name == "ngram:2"
    assert two.tokenizer_fingerprint is None
    assert isinstance(two, Drafter)


@pytest.mark.parametrize("spec", ["bogus", "hf", "hf:", "ngramx", "", "ngram:x", "ngram:0"])
def test_load_drafter_bad_spec_names_it(spec):
    with pytest.raises(ValueError) as info:
        load_drafter(spec)
    assert repr(spec) in str(info.value)


def test_load_drafter_hf_from_a_saved_model(tmp_path, tokenizer):
    _, drafter_dir = save_pair(tmp_path)
    drafter = load_drafter(f"hf:{drafter_dir}", q_support=7)
    assert isinstance(drafter, HFDrafter) and drafter.q_support == 7
    assert drafter.tokenizer_fingerprint == fingerprint_tokenizer(tokenizer)
    assert len(drafter.propose(tokenizer("def add").input_ids, 3, GREEDY).token_ids) == 3


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0


# --- HF drafter ------------------------------------------------------------------------------

def greedy_oracle(model, context: list[int], k: int) -> list[int]:
    """Greedy continuation by full recomputation, no cache: the model's own greedy choice."""
    tokens = list(context)
    with torch.no_grad():
        for _ in range(k):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


@pytest.fixture(scope="module")
def long_context(tokenizer) -> list[int]:
    """Longer than gemma3's sliding window (16), so rollback crosses it."""
    ids = tokenizer(LONG_TEXT).input_ids
    assert len(ids) > 24
    return ids


ARCHS = ["llama", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_greedy_proposals_equal_the_models_greedy_continuation(models, tokenizer, prompts,
                                                                  long_context, arch):
    model = models[arch]
    drafter = HFDrafter(model, tokenizer)
    for context in [*prompts[:4], long_context]:  # one drafter, contexts one after another
        proposal = drafter.propose(context, 6, GREEDY)
        assert proposal.q is None
        assert proposal.token_ids == greedy_oracle(model, context, 6)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_greedy_matches_transformers_generate(models, tokenizer, prompts, arch):
    model = models[arch]
    prompt = prompts[0]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    expected = out[0, len(prompt):].tolist()
    assert HFDrafter(model, tokenizer).propose(prompt, len(expected), GREEDY).token_ids == expected


def sampled(drafter: HFDrafter, context: list[int], k: int, seed: int) -> Proposal:
    return drafter.propose(context, k, SAMPLING, np.random.default_rng(seed))




@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_hf_rollback_then_new_context_equals_a_fresh_drafter(models, tokenizer, long_context,
                                                            arch, mode):
    """propose(A), rollback(L), propose(B) with B = A[:L] + other tokens == fresh propose(B)."""
    model = models[arch]
    k = 5
    first = long_context
    others = [7, 41, 300, 12, 99, 150, 5]
    for keep in (1, 4, 17, len(first) - 3, len(first) - 1, len(first), len(first) + k - 1):
        drafter = HFDrafter(model, tokenizer)
        _ = drafter.propose(first, k, GREEDY) if mode == "greedy" else sampled(drafter, first, k, 0)
        seen = first + _.token_ids[:-1]       # what the cache holds now
        assert drafter._cache.get_seq_length() == len(seen)
        drafter.rollback(keep)
        assert drafter._cache.get_seq_length() == min(keep, len(seen))
        second = seen[:keep] + others
        if mode == "greedy":
            got = drafter.propose(second, k, GREEDY)
            want = HFDrafter(model, tokenizer).propose(second, k, GREEDY)
            assert want.token_ids == greedy_oracle(model, second, k)
        else:
            got = sampled(drafter, second, k, 1)
            want = sampled(HFDrafter(model, tokenizer), second, k, 1)
        assert_same_proposal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_rounds_like_a_device_equal_fresh_drafters(models, tokenizer, prompts, arch):
    """The device loop: propose, keep a prefix of the draft plus a correction, propose again."""
    model = models[arch]
    drafter = HFDrafter(model, tokenizer, q_support=16)
    rng = random.Random(arch)
    context = list(prompts[1])
    for round_ in range(8):
        k = rng.randrange(1, 6)
        got = sampled(drafter, context, k, round_)
        fresh = HFDrafter(model, tokenizer, q_support=16)
        assert_same_proposal(got, sampled(fresh, context, k, round_))
        accepted = rng.randrange(0, k + 1)
        drafter.rollback(len(context) + accepted)
        context += got.token_ids[:accepted] + [rng.randrange(3, 320)]


@pytest.mark.parametrize("sampling,q_support", [
    (SAMPLING, 32),
    (Sampling(temperature=1.5), 8),
    (Sampling(temperature=0.7, top_k=5), 32),   # top-k narrower than q_support
    (Sampling(temperature=1.0, top_p=0.3), 64),
])
def test_hf_sampling_returns_q_per_token(models, tokenizer, prompts, sampling, q_support):
    drafter = HFDrafter(models["llama"], tokenizer, q_support=q_support)
    widths = []
    for seed, context in enumerate(prompts):
        proposal = drafter.propose(context, 6, sampling, np.random.default_rng(seed))
        widths += assert_valid_q(proposal, 6, sampling, q_support, len(tokenizer))
    if sampling.top_p == 1.0 and sampling.top_k == 0:
        assert max(widths) == q_support  # truncated to q_support, not narrower


def test_hf_same_seed_same_proposal(models, tokenizer, prompts):
    model = models["llama"]
    context = prompts[2]
    first = sampled(HFDrafter(model, tokenizer), context, 8, seed=11)
    again = sampled(HFDrafter(model, tokenizer), context, 8, seed=11)
    assert_same_proposal(again, first)
    # The same drafter, warm cache, same seed: still the same.
    reused = HFDrafter(model, tokenizer)
    sampled(reused, prompts[3], 4, seed=0)
    assert_same_proposal(sampled(reused, context, 8, seed=11), first)
    others = {tuple(sampled(HFDrafter(model, tokenizer), context, 8, seed=s).token_ids)
              for s in range(12, 20)}
    assert others != {tuple(first.token_ids)}  # the seed matters


def test_hf_tokenizer_fingerprint(models, tokenizer):
    drafter = HFDrafter(models["llama"], tokenizer)
    assert drafter.tokenizer_fingerprint == fingerprint_tokenizer(tokenizer)
    assert HFDrafter(models["llama"]).tokenizer_fingerprint is None


# --- fingerprints ----------------------------------------------------------------------------

def test_fingerprint_same_vocab_same_hash():
    vocab = {"a": 0, "b": 1, "c": 2}
    assert fingerprint_vocab(vocab) == fingerprint_vocab({"c": 2, "a": 0, "b": 1})  # order-free
    assert fingerprint_vocab(vocab).startswith("sha256:")
    assert len(fingerprint_vocab(vocab)) == len("sha256:") + 64
    assert short(fingerprint_vocab(vocab)) == fingerprint_vocab(vocab)[:19]
    assert fingerprint_tokenizer(make_tokenizer()) == fingerprint_tokenizer(make_tokenizer())


def test_fingerprint_format_is_pinned():
    """Device and server may run different sled versions: the hashed text is a contract."""
    expected = hashlib.sha256("0\ta\n1\tb\n".encode()).hexdigest()
    assert fingerprint_vocab({"b": 1, "a": 0}) == f"sha256:{expected}"


def test_fingerprint_changes_with_any_id():
    vocab = {"a": 0, "b": 1, "c": 2}
    assert fingerprint_vocab({"a": 1, "b": 0, "c": 2}) != fingerprint_vocab(vocab)  # ids swapped
    assert fingerprint_vocab({"a": 0, "b": 1, "d": 2}) != fingerprint_vocab(vocab)  # token renamed
    assert fingerprint_vocab({"a": 0, "b": 1}) != fingerprint_vocab(vocab)          # token dropped


def test_fingerprint_of_a_real_tokenizer_sees_a_swap(tokenizer):
    vocab = tokenizer.get_vocab()
    assert fingerprint_vocab(vocab) == fingerprint_tokenizer(tokenizer)
    swapped = dict(vocab)
    a, b = sorted(vocab, key=vocab.get)[100:102]
    swapped[a], swapped[b] = vocab[b], vocab[a]
    assert fingerprint_vocab(swapped) != fingerprint_tokenizer(tokenizer)
    assert fingerprint_tokenizer(make_tokenizer(vocab_size=300)) != fingerprint_tokenizer(tokenizer)
