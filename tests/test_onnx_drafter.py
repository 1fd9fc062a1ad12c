"""The ONNX drafter (onnxruntime-genai) and `sled export-onnx`: tiny random models exported to fp32
ONNX once per module, checked against the float64 HF model's own greedy choices, KV rollback
against fresh drafters, the tokens appended per round, sampling's q; the real smollm2 int4 export
is marked slow."""
from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import assert_same_proposal as assert_close_proposal
from conftest import assert_valid_q, cached_reference
from transformers import AutoModelForCausalLM

from drafters import load_drafter
from drafters.base import Drafter, Proposal
from drafters.onnx import ONNXDrafter
from sled.wire.fingerprint import fingerprint_tokenizer
from sled.wire.sampling import Sampling
from drafters.onnx_export import export
from lab.tiny import save_pair

GREEDY = Sampling()
SAMPLING = Sampling(temperature=0.9, top_k=50, top_p=0.95)
LONG_TEXT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
ARCHS = ["llama", "gemma3"]  # gemma3's sliding window (16) is shorter than the long context


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple]:
    """arch -> (fp32 ONNX folder, the float64 HF model it was exported from)."""
    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for arch in ARCHS:
        _, hf_dir = save_pair(root / "hf", arch)
        onnx_dir = export(str(hf_dir), root / f"{arch}-fp32", precision="fp32")
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
        out[arch] = (onnx_dir, model)
    return out


@pytest.fixture(scope="module")
def long_context(tokenizer) -> list[int]:
    ids = tokenizer(LONG_TEXT).input_ids
    assert len(ids) > 24
    return ids


def greedy_oracle(model, context: list[int], k: int) -> list[int]:
    """Greedy continuation by full recomputation in float64, no cache."""
    tokens = list(context)
    with torch.no_grad():
        for _ in range(k):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


def sampled(drafter: ONNXDrafter, context: list[int], k: int, seed: int,
            sampling: Sampling = SAMPLING) -> Proposal:
    return drafter.propose(context, k, sampling, np.random.default_rng(seed))


def assert_same_proposal(got: Proposal, want: Proposal) -> None:
    """ONNX Runtime's kernels reorder float sums more than torch's: a looser q tolerance."""
    assert_close_proposal(got, want, rtol=1e-4, atol=1e-5)


class AppendSpy:
    """Wraps the og.Generator: records the length of every append_tokens call."""

    def __init__(self, inner) -> None:
        self.inner, self.appended = inner, []

    def append_tokens(self, tokens) -> None:
        self.appended.append(len(tokens))
        self.inner.append_tokens(tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_proposals_equal_the_models_greedy_continuation(exported, prompts, long_context,
                                                               arch):
    folder, model = exported[arch]
    drafter = ONNXDrafter(folder)
    for context in [*prompts[:4], long_context, prompts[0]]:  # one drafter, contexts in turn
        proposal = drafter.propose(context, 6, GREEDY)
        assert proposal.q is None
        assert proposal.token_ids == greedy_oracle(model, context, 6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_rollback_then_new_context_equals_a_fresh_drafter(exported, long_context, arch, mode):
    """propose(A), rollback(L), propose(B) with B = A[:L] + other tokens == fresh propose(B)."""
    folder, model = exported[arch]
    k = 5
    first = long_context
    others = [7, 41, 300, 12, 99, 150, 5]
    drafter = ONNXDrafter(folder)
    for keep in (1, 4, 17, len(first) - 3, len(first) - 1, len(first), len(first) + k - 1):
        drafter.rollback(0)
        _ = drafter.propose(first, k, GREEDY) if mode == "greedy" else sampled(drafter, first, k, 0)
        seen = first + _.token_ids[:-1]       # what the KV cache holds now
        assert drafter.generator.token_count() == len(seen)
        drafter.rollback(keep)
        assert drafter.generator.token_count() == min(keep, len(seen))
        second = seen[:keep] + others
        if mode == "greedy":
            got = drafter.propose(second, k, GREEDY)
            want = ONNXDrafter(folder).propose(second, k, GREEDY)
            assert want.token_ids == greedy_oracle(model, second, k)
        else:
            got = sampled(drafter, second, k, 1)
            want = sampled(ONNXDrafter(folder), second, k, 1)
        assert_same_proposal(got, want)


def test_each_round_appends_only_new_tokens(exported, prompts):
    """The device loop: a round appends only the context not yet seen, then one token per draft."""
    folder, _ = exported["llama"]
    drafter = ONNXDrafter(folder, q_support=16)
    drafter.generator = spy = AppendSpy(drafter.generator)
    rng = random.Random(0)
    context = list(prompts[1])
    proposal = drafter.propose(context, 4, GREEDY)
    assert spy.appended == [len(context), 1, 1, 1]  # the prefill once, then k - 1 drafts fed
    total = sum(spy.appended)
    for round_ in range(12):
        drafted = len(proposal.token_ids)
        accepted = rng.randrange(0, drafted + 1)
        drafter.rollback(len(context) + accepted)
        context += proposal.token_ids[:accepted] + [rng.randrange(3, 320)]  # + the correction
        spy.appended.clear()
        k = rng.randrange(1, 6)
        proposal = (sampled(drafter, context, k, round_) if round_ % 2
                    else drafter.propose(context, k, GREEDY))
        # New: the correction, and the last draft too when all were accepted (it was never fed).
        assert spy.appended == [2 if accepted == drafted else 1] + [1] * (k - 1)
        assert drafter.generator.token_count() == len(context) + k - 1
        total += sum(spy.appended)
    assert drafter.evaluated == total


@pytest.mark.parametrize("sampling,q_support", [
    (SAMPLING, 32),
    (Sampling(temperature=1.5), 8),
    (Sampling(temperature=0.7, top_k=5), 32),   # top-k narrower than q_support
    (Sampling(temperature=1.0, top_p=0.3), 64),
])
def test_sampling_returns_q_per_token(exported, tokenizer, prompts, sampling, q_support):
    folder, _ = exported["llama"]
    drafter = ONNXDrafter(folder, q_support=q_support)
    widths = []
    for seed, context in enumerate(prompts):
        proposal = sampled(drafter, context, 6, seed, sampling)
        widths += assert_valid_q(proposal, 6, sampling, q_support, len(tokenizer))
    if sampling.top_p == 1.0 and sampling.top_k == 0:
        assert max(widths) == q_support  # truncated to q_support, not narrower


def test_same_seed_same_proposal(exported, prompts):
    folder, _ = exported["llama"]
    context = prompts[2]
    first = sampled(ONNXDrafter(folder), context, 8, seed=11)
    reused = ONNXDrafter(folder)
    sampled(reused, prompts[3], 4, seed=0)  # a warm cache, another context first
    assert_same_proposal(sampled(reused, context, 8, seed=11), first)
    others = {tuple(sampled(reused, context, 8, seed=s).token_ids) for s in range(12, 20)}
    assert others != {tuple(first.token_ids)}  # the seed matters


def test_load_drafter_onnx(exported, tokenizer, prompts, monkeypatch):
    folder, model = exported["llama"]
    monkeypatch.setenv("SLED_DRAFTER_THREADS", "1")
    drafter = load_drafter(f"onnx:{folder}", q_support=7)
    assert isinstance(drafter, ONNXDrafter) and isinstance(drafter, Drafter)
    assert drafter.q_support == 7 and drafter.n_threads == 1
    assert drafter.name == f"onnx:{folder}"
    assert drafter.max_length == 1024  # the model's context_length
    assert drafter.tokenizer_fingerprint == fingerprint_tokenizer(tokenizer)
    assert drafter.propose(prompts[0], 3, GREEDY).token_ids == greedy_oracle(model, prompts[0], 3)


def test_missing_or_wrong_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no genai_config.json.*sled export-onnx"):
        load_drafter(f"onnx:{tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="'onnx:'"):
        load_drafter("onnx:")


def test_kv_buffer_is_capped_by_default_not_sized_to_the_full_context(exported):
    folder, _ = exported["llama"]  # the tiny model's context is 1024
    assert ONNXDrafter(folder, max_length=None).max_length == 1024
    assert ONNXDrafter(folder, max_length=512).max_length == 512
    assert ONNXDrafter(folder, max_length=8192).max_length == 1024  # never past the model's own


def test_context_beyond_max_length_is_refused(exported, prompts):
    folder, _ = exported["llama"]
    drafter = ONNXDrafter(folder, max_length=16)
    assert len(drafter.propose(list(range(3, 15)), 4, GREEDY).token_ids) == 4  # 12 + 3 fed
    with pytest.raises(ValueError, match="max_length 16"):
        drafter.propose(list(range(3, 15)), 6, GREEDY)


def test_export_refuses_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export(str(tmp_path), tmp_path / "out", precision="fp32")
    _, hf_dir = save_pair(tmp_path / "hf", "llama")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an ONNX export"):
        export(str(hf_dir), tmp_path / "busy", precision="fp32")
    with pytest.raises(ValueError, match="precision"):
        export(str(hf_dir), tmp_path / "out", precision="int3")


def test_a_builder_failure_says_why_and_leaves_no_output(tmp_path):
    import json
    import shutil

    _, hf_dir = save_pair(tmp_path / "hf", "llama")
    odd = tmp_path / "odd"
    shutil.copytree(hf_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["OddForCausalLM"]}))
    with pytest.raises(RuntimeError, match="(?s)model builder failed.*not currently supported"):
        export(str(odd), tmp_path / "out", precision="fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "odd"]


def test_resolve_spec_leaves_onnx_folders_alone(tmp_path):
    from drafters import resolve_spec

    assert resolve_spec(f"onnx:{tmp_path}") == f"onnx:{tmp_path}"
    assert resolve_spec("onnx:smollm2-135m-int3") == "onnx:smollm2-135m-int3"


def test_cli_export_onnx(tmp_path, tokenizer, prompts, exported):
    """`sled export-onnx` as a subprocess: the same model as the in-process export."""
    _, hf_dir = save_pair(tmp_path / "hf", "llama")
    out = tmp_path / "cli-export"
    done = subprocess.run([sys.executable, "-m", "sled_cli.main", "export-onnx", str(hf_dir),
                           str(out), "--precision", "fp32"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert {"genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".cli-export.partial-*"))  # the build folder was swapped in
    drafter = load_drafter(f"onnx:{out}")
    assert drafter.tokenizer_fingerprint == fingerprint_tokenizer(tokenizer)
    want = ONNXDrafter(exported["llama"][0]).propose(prompts[0], 5, GREEDY)
    assert drafter.propose(prompts[0], 5, GREEDY) == want
    # Exporting again over an earlier export replaces it.
    again = subprocess.run([sys.executable, "-m", "sled_cli.main", "export-onnx", str(hf_dir),
                            str(out), "--precision", "fp32"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr


def test_cli_export_onnx_needs_out_for_a_folder(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sled_cli.main", "export-onnx", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "OUT_DIR is required" in done.stderr


# --- the real smollm2-135m int4 export --------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    """onnx:smollm2-135m, exported into the sled cache on first use, and its HF checkpoint."""
    from drafters import resolve_spec
    from sled.models import hf_checkpoint

    folder = resolve_spec("onnx:smollm2-135m").partition(":")[2]
    return folder, hf_checkpoint("smollm2-135m")


@pytest.mark.slow
def test_smollm2_int4_rounds_commit_the_runtimes_own_greedy_text(smollm2):
    """Rounds of k with rollback give the text of onnxruntime-genai's own greedy loop."""
    import numpy as np
    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    folder, checkpoint = smollm2
    drafter = ONNXDrafter(folder, n_threads=2)
    assert "int4" in folder
    target_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert drafter.tokenizer_fingerprint == fingerprint_tokenizer(target_tokenizer)  # a valid pair
    prompt = AutoTokenizer.from_pretrained(folder)(LONG_TEXT).input_ids
    params = og.GeneratorParams(drafter.model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + 48)
    native = og.Generator(drafter.model, params)
    native.append_tokens(np.asarray(prompt, dtype=np.int32))
    while not native.is_done():
        native.generate_next_token()
    want = native.get_sequence(0)[len(prompt):].tolist()
    context = list(prompt)
    rng = random.Random(0)
    while len(context) - len(prompt) < len(want):
        draft = drafter.propose(context, 4, GREEDY).token_ids
        accepted = rng.randrange(0, 4)  # then the drafter's own next token as the "correction"
        context += draft[:accepted + 1]
        drafter.rollback(len(context))
    assert context[len(prompt):len(prompt) + len(want)] == want


@pytest.mark.slow
def test_smollm2_int4_agrees_with_the_float_model_mostly(smollm2):
    """int4 drafts track the dequantized target: teacher-forced top-1 agreement
    (measured 0.85 on this text, 0.76 over mixed prose and code)."""
    from transformers import AutoTokenizer

    folder, checkpoint = smollm2
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompt = tokenizer(LONG_TEXT).input_ids
    text = prompt + cached_reference(model, prompt, 48)
    drafter = ONNXDrafter(folder, n_threads=2)
    agree = sum(drafter.propose(text[:i], 1, GREEDY).token_ids[0] == text[i]
                for i in range(len(prompt), len(text)))
    assert agree / (len(text) - len(prompt)) >= 0.5
