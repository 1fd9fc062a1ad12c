"""The greedy references of real models are kept on disk (conftest.cached_reference): computed once
for what they depend on, read back after that, and computed again when what is kept is not a whole
answer. Checked on the tiny checkpoint, with a cache of the test's own."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import conftest
from conftest import cached_reference


@pytest.fixture
def model(pair):
    """The tiny target, loaded from its checkpoint folder as the real ones are."""
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float64).eval()


@pytest.fixture
def computed(monkeypatch, tmp_path) -> list:
    """Each generate() a reference costs, with the references kept under tmp_path."""
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    calls, compute = [], conftest.generated

    def counted(*args):
        calls.append(args)
        return compute(*args)

    monkeypatch.setattr(conftest, "generated", counted)
    return calls


def own_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_reference_is_generate_computed_once_then_read(model, prompts, computed, tmp_path):
    reference = cached_reference(model, prompts[0], 8)
    assert reference == own_generate(model, prompts[0], 8)
    assert cached_reference(model, prompts[0], 8) == reference and len(computed) == 1
    kept = sorted(p.name for p in (tmp_path / "references").iterdir())
    assert [name for name in kept if not name.endswith((".json", ".lock"))] == []  # no temp file left


def test_what_a_reference_depends_on_keys_it(model, prompts, computed, pair):
    cached_reference(model, prompts[0], 8)
    cached_reference(model, prompts[1], 8)                 # another prompt
    cached_reference(model, prompts[0], 6)                 # another length
    cached_reference(model, prompts[0], 8, eos=5)          # another EOS
    assert len(computed) == 4
    weights = pair[0] / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    cached_reference(model, prompts[0], 8)                 # the checkpoint changed
    assert len(computed) == 5


@pytest.mark.parametrize("kept", [b"", b"{not json", b'{"key": {}, "tokens": [1, 2]}',
                                  b'{"tokens": "abc"}', b"[1, 2, 3]"])
def test_a_kept_file_that_is_not_a_whole_answer_is_computed_again(model, prompts, computed,
                                                                   tmp_path, kept):
    reference = cached_reference(model, prompts[2], 8)
    [path] = (tmp_path / "references").glob("*.json")
    path.write_bytes(kept)
    assert cached_reference(model, prompts[2], 8) == reference and len(computed) == 2
    assert cached_reference(model, prompts[2], 8) == reference and len(computed) == 2  # kept again


def test_a_model_made_in_memory_has_no_reference_kept(models, prompts, computed):
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        cached_reference(models["llama"], prompts[0], 8)
    assert computed == []
