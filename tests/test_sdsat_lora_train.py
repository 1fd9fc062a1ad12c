"""Training a SAT LoRA adapter by self-distillation: the greedy labels, the packed cuts (equal to one
forward per cut), a run that learns, resumes bit-identically and hands the target back untouched,
and `sled sdsat train --mode lora` end to end."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import greedy_reference
from lab.tiny import save_pair
from sled_cli.main import main
from verify_server.sat_lora import peft_config
from verify_server.sdsat import ADAPTER_FILE, adapter_metadata, load_adapter
from sdsat.distill import (DistillSet, DistillSpec, body_offsets, build_distill_set,
                                         draw_prompts)
from sdsat.lora import (LoraRun, LoraTrainConfig, cut_labels, cut_mask, draw_cuts,
                                      packed_sat_logits, train_sat_lora)
from sdsat.train import Checkpoints


def test_each_cut_sees_the_real_tokens_before_it_and_its_own_earlier_slots():
    mask = cut_mask(6, torch.tensor([[3, 5]]), slots=2)[0, 0].int()
    assert mask.tolist() == [
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0],   # S1 of cut 3: x0..x2, itself
        [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],   # S2 of cut 3: x0..x2, S1 and itself
        [1, 1, 1, 1, 1, 0, 0, 0, 1, 0],   # S1 of cut 5
        [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]]   # S2 of cut 5


def test_slot_j_of_cut_c_is_labelled_with_token_c_plus_j():
    sequences = torch.arange(20).reshape(2, 10)
    assert cut_labels(sequences, torch.tensor([[3, 6], [2, 4]]), 3).tolist() == \
        [[[4, 5, 6], [7, 8, 9]], [[13, 14, 15], [15, 16, 17]]]


@pytest.fixture
def lora_run(models):
    model = copy.deepcopy(models["llama"]).float()
    data = DistillSet(torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(0)), 8)
    return LoraRun(model, LoraTrainConfig(slots=3, rank=4, steps=4, batch=2, cuts=5), data)


def test_packed_cuts_equal_one_forward_per_cut(lora_run):
    """Many cuts after one prefix pass give what each cut alone gives: the prefix with the adapter
    off, then its slots with the adapter on."""
    with torch.no_grad():   # deltas away from zero, so the adapter's side matters
        for param in lora_run.deltas:
            param.add_(torch.randn_like(param) * 0.2)
    model, embeddings = lora_run.model, lora_run.embeddings.detach()
    sequences, cuts = lora_run.data.sequences[:2], torch.tensor([[9, 14, 20], [8, 11, 17]])
    with torch.no_grad():
        packed = packed_sat_logits(model, embeddings, sequences, cuts)
        for b in range(2):
            for k, cut in enumerate(cuts[b].tolist()):
                with model.disable_adapter():
                    cache = model(input_ids=sequences[b:b + 1, :cut], use_cache=True).past_key_values
                alone = model(inputs_embeds=embeddings[None], past_key_values=cache, use_cache=True,
                              position_ids=torch.arange(cut, cut + 3)[None]).logits[0]
                torch.testing.assert_close(packed[b, k], alone, rtol=1e-4, atol=1e-4)


def test_a_window_too_short_for_the_packed_cuts_is_refused(models):
    model = copy.deepcopy(models["gemma3"]).float()   # sliding window 16
    data = DistillSet(torch.randint(3, 200, (2, 14)), 6)
    run = LoraRun(model, LoraTrainConfig(slots=2, rank=2), data)
    with pytest.raises(ValueError, match="16-token sliding window"):
        packed_sat_logits(run.model, run.embeddings, data.sequences, torch.tensor([[6, 8], [7, 9]]))


def test_greedy_continuations_are_the_targets_own(models, tokenizer):
    model = copy.deepcopy(models["llama"])
    documents = ["alpha beta gamma\ndelta epsilon zeta eta\ntheta iota kappa lambda mu\n" * 4]
    data = build_distill_set(model, tokenizer, documents,
                             DistillSpec(prompt_len=10, new_tokens=6, count=3, seed=1), batch=2)
    assert data.sequences.shape == (3, 16)
    for row in data.sequences.tolist():
        assert row[10:] == greedy_reference(model, row[:10], 6)
    prompts = draw_prompts(tokenizer, documents, 10, 3, seed=1)
    assert torch.equal(prompts, data.sequences[:, :10]) and (prompts[:, 0] == tokenizer.bos_token_id).all()


MODULE = '''import os


def add(a, b):
    """Add two numbers.

    >>> add(1, 2)
    3
    """
    total = a + b
    return total


def bare(x):
    return x


def only_doc():
    """Nothing else."""


class Box:
    def size(self):
        "The size."
        return 3
'''


def test_body_prompts_end_where_a_documented_functions_body_begins(tokenizer):
    """The shape of a completion request: a docstring, then the target writes the body. Functions
    without a docstring, or with nothing after it, give no prompt."""
    offsets = body_offsets(MODULE)
    assert [MODULE[o:].split("\n")[0] for o in offsets] == ["    total = a + b", "        return 3"]
    assert body_offsets("def broken(:\n") == []
    prompts = draw_prompts(tokenizer, [MODULE], 8, 6, seed=0, at="bodies")
    texts = {tokenizer.decode(row[1:]) for row in prompts.tolist()}
    assert len(texts) == 2
    assert all(t.rstrip(" ").endswith(('"""\n', 'size."\n')) for t in texts)
    with pytest.raises(ValueError, match="unknown prompt shape 'middles'"):
        draw_prompts(tokenizer, [MODULE], 8, 1, seed=0, at="middles")
    with pytest.raises(ValueError, match="no corpus document has a 8-token prompt of shape 'bodies'"):
        draw_prompts(tokenizer, ["x = 1\n"], 8, 1, seed=0, at="bodies")


def test_training_goes_on_from_a_given_adapter(lora_run):
    with torch.no_grad():
        for param in lora_run.deltas:
            param.add_(torch.randn_like(param) * 0.2)
    saved = lora_run.spec()
    model = lora_run.model.get_base_model()
    lora_run.unload()
    again = LoraRun(model, lora_run.config, lora_run.data, saved)
    assert torch.equal(again.embeddings.detach(), saved.embeddings)
    for path, (a, b) in again.spec().lora.weights.items():
        assert torch.equal(a, saved.lora.weights[path][0]) and torch.equal(b, saved.lora.weights[path][1])
    again.unload()
    with pytest.raises(ValueError, match="has 3 slots, rank 4, alpha 16; this run has 3, 2, 16"):
        LoraRun(model, _with(lora_run.config, rank=2), lora_run.data, saved)
    saved.lora = None
    with pytest.raises(ValueError, match="no LoRA deltas"):
        LoraRun(model, lora_run.config, lora_run.data, saved)


def counting(count: int) -> DistillSet:
    """Sequences that count by 1 or 2: what comes after a cut follows from what came before."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        start = int(torch.randint(10, 150, (1,), generator=generator))
        step = int(torch.randint(1, 3, (1,), generator=generator))
        rows.append([start + step * j for j in range(24)])
    return DistillSet(torch.tensor(rows), 8)


def test_training_learns_resumes_bit_identically_and_leaves_the_target_untouched(models, tmp_path):
    base = copy.deepcopy(models["llama"]).float()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    train, held = counting(40).split(8)
    config = LoraTrainConfig(slots=2, rank=4, steps=30, batch=4, cuts=6, lr=1e-2, eval_every=15)
    spec, log = train_sat_lora(base, train, held, config)
    assert log[-1]["heldout"]["loss"] < log[0]["heldout"]["loss"] - 1.0
    assert spec.lora is not None and spec.lora.rank == 4
    assert set(spec.lora.weights) == {p for p, _ in base.named_modules()
                                      if p.rsplit(".", 1)[-1] in peft_config(4, 8).target_modules}
    assert base.state_dict().keys() == before.keys()          # no peft layers left behind
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())

    halves = [copy.deepcopy(models["llama"]).float() for _ in range(2)]
    folder = tmp_path / "ckpt"
    straight, _ = train_sat_lora(halves[0], train, held, _with(config, steps=12))
    train_sat_lora(halves[1], train, held, _with(config, steps=6, save_every=6),
                   checkpoints=Checkpoints(folder))
    resumed, _ = train_sat_lora(halves[1], train, held, _with(config, steps=12, save_every=6),
                                checkpoints=Checkpoints(folder, resume=True))
    assert torch.equal(resumed.embeddings, straight.embeddings)
    for path, (a, b) in straight.lora.weights.items():
        assert torch.equal(resumed.lora.weights[path][0], a) and torch.equal(resumed.lora.weights[path][1], b)


def _with(config: LoraTrainConfig, **changes) -> LoraTrainConfig:
    from dataclasses import asdict

    return LoraTrainConfig(**{**asdict(config), **changes})


def test_sdsat_train_lora_command_writes_an_adapter_the_server_loads(tmp_path, capsys):
    target, _ = save_pair(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\nclass Box:\n    size = 3\n" * 20)
    out = tmp_path / "sat"
    assert main(["sdsat", "train", "--model", str(target), "--corpus", str(corpus), "--mode", "lora",
                 "--out", str(out), "--slots", "2", "--steps", "4", "--batch", "2", "--cuts", "3",
                 "--prompts", "6", "--prompt-len", "12", "--new-tokens", "8", "--heldout", "0.34",
                 "--rank", "2", "--eval-every", "2"]) == 0
    spec = load_adapter(out / ADAPTER_FILE)
    assert spec.kind == "lora" and spec.slots == 2 and spec.lora.rank == 2
    logged = capsys.readouterr().err          # not a terminal: plain progress lines
    assert "greedy continuations: 6 of 6 prompts" in logged and "step 4 of 4: loss" in logged
    meta = adapter_metadata(out / ADAPTER_FILE)
    assert meta["mode"] == "lora" and meta["labels"] == "target greedy continuation"
    assert meta["training_cuts"] == str(4 * 2 * 3) and meta["generated_tokens"] == str(6 * 8)
    assert (out / "train_log.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "checkpoint").exists()
    from transformers import AutoModelForCausalLM

    spec.check(AutoModelForCausalLM.from_pretrained(target))
    assert main(["sdsat", "train", "--model", str(target), "--corpus", str(corpus), "--mode", "lora",
                 "--out", str(tmp_path / "bad"), "--prompts", "2", "--heldout", "0.9"]) == 2
    assert main(["sdsat", "train", "--model", str(target), "--corpus", str(corpus), "--mode", "lora",
                 "--out", str(tmp_path / "bad"), "--init-adapter", str(tmp_path / "none")]) == 2
    assert main(["sdsat", "train", "--model", str(target), "--corpus", str(corpus), "--mode", "lora",
                 "--out", str(tmp_path / "bad"), "--init-adapter", str(out / ADAPTER_FILE),
                 "--rank", "3", "--slots", "2"]) == 2


def test_bad_training_settings_are_refused():
    with pytest.raises(ValueError, match="rank must be at least 1"):
        LoraTrainConfig(rank=0)
    with pytest.raises(ValueError, match="lr, embedding_lr and alpha must be > 0"):
        LoraTrainConfig(embedding_lr=0.0)
    with pytest.raises(ValueError, match="leave no cut"):
        draw_cuts(DistillSet(torch.zeros(2, 10, dtype=torch.long), 7), torch.tensor([0]), 4, 3,
                  torch.Generator())


def test_an_interrupted_generation_continues_from_its_saved_rows(models, tokenizer, tmp_path):
    model = copy.deepcopy(models["llama"])
    documents = ["one two three four\nfive six seven eight nine\nten eleven twelve\n" * 4]
    spec = DistillSpec(prompt_len=8, new_tokens=4, count=3, seed=3)
    kwargs = dict(batch=1, cache=tmp_path / "distill.pt")

    def interrupt_after_two(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_distill_set(model, tokenizer, documents, spec, on_batch=interrupt_after_two, **kwargs)
    calls = []
    generate = model.generate
    model.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    data = build_distill_set(model, tokenizer, documents, spec, **kwargs)
    assert len(calls) == 1                                        # only the third prompt
    model.generate = generate
    assert torch.equal(data.sequences, build_distill_set(
        model, tokenizer, documents, spec, **{**kwargs, "cache": None}).sequences)
