"""The command line as a person uses it: `sled serve` and `sled generate` as real processes."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import run_sled
from lab.server_process import ServerProcess, free_port


def sled(*args: str, timeout: float = 120):
    return run_sled(*args, timeout=timeout)


async def test_generate_json_is_lossless_against_a_served_target(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SLED_CACHE", str(tmp_path))  # the tokenizer is bootstrapped from the server
    target_dir, drafter_dir = pair
    async with ServerProcess(str(target_dir), "--dtype", "float64") as server:
        done = sled("generate", "--server", server.address, "--drafter", f"hf:{drafter_dir}",
                    "--prompt", "def fib(n):", "--max-new-tokens", "20", "--draft-len", "3", "--json")
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        streamed = sled("generate", "--server", server.address, "--drafter", "ngram",
                        "--prompt", "def fib(n):", "--max-new-tokens", "20")
        metrics_forward = server.metric("sled_forward_passes_total")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    prompt = tokenizer("def fib(n):").input_ids
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    assert out["token_ids"] == reference
    assert out["text"] == tokenizer.decode(reference)
    assert out["finish_reason"] == "length"
    assert out["rounds"] >= 20 / 4 and out["draft_tokens"] >= out["accepted_tokens"] > 0
    assert out["accepted_tokens"] + out["rounds"] == len(reference)  # each round: accepted + 1
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip("\n") == tokenizer.decode(reference)
    assert "tokens/round" in streamed.stderr
    assert metrics_forward > 0


def test_generate_explains_an_unreachable_server():
    done = sled("generate", "--server", f"127.0.0.1:{free_port()}", "--prompt", "hi", timeout=60)
    assert done.returncode == 3
    assert "cannot reach a sled server" in done.stderr


def test_generate_rejects_an_unknown_drafter_spec():
    done = sled("generate", "--server", "127.0.0.1:1", "--drafter", "magic:x", "--prompt", "hi")
    assert done.returncode == 2 and "unknown drafter spec 'magic:x'" in done.stderr


def test_models_prepare_names_the_built_in_models_for_an_unknown_one():
    done = sled("models", "prepare", "no-such-model")
    assert done.returncode == 2 and "unknown model 'no-such-model'" in done.stderr
    assert "gemma3-270m" in done.stderr


def test_generate_rejects_a_draft_len_below_one_before_connecting():
    done = sled("generate", "--server", "127.0.0.1:1", "--draft-len", "0", "--prompt", "hi")
    assert done.returncode == 2 and "draft_len must be >= 1" in done.stderr
    assert "Traceback" not in done.stderr


async def test_generate_reports_a_refused_tokenizer(pair, tmp_path, monkeypatch):
    """A drafter whose tokenizer differs from the target's is refused with both named."""
    from lab.tiny import make_model, make_tokenizer

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    other = tmp_path / "other-drafter"
    tokenizer = make_tokenizer(vocab_size=300)
    make_model("llama", len(tokenizer)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    async with ServerProcess(str(pair[0])) as server:
        done = sled("generate", "--server", server.address, "--drafter", f"hf:{other}",
                    "--prompt", "def fib(n):", "--max-new-tokens", "5")
    assert done.returncode == 4
    assert "FAILED_PRECONDITION" in done.stderr and "tokenizer" in done.stderr


def test_bench_overhead_reports_percentiles(pair, tmp_path):
    out = tmp_path / "overhead.json"
    done = sled("bench", "overhead", "--model", str(pair[0]), "--rounds", "30", "--out", str(out),
                timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["rounds"] >= 30
    overhead = result["summary"]["overhead (ms)"]
    assert 0 < overhead["p50"] <= overhead["p95"]
    assert 0 < result["summary"]["overhead / round"]["p50"] < 1
    assert "overhead / round" in done.stdout


def test_bench_overhead_sets_secured_access_beside_plain(pair, tmp_path):
    """--access plain,mtls: the same rounds against a plaintext server and a mutual-TLS one with
    a pinned device token, and each overhead set beside plain's."""
    out = tmp_path / "overhead.json"
    done = sled("bench", "overhead", "--model", str(pair[0]), "--rounds", "20", "--access",
                "plain,mtls", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert list(result["access"]) == ["plain", "mtls"]
    assert result["access"]["mtls"]["rounds"] >= 20
    assert result["access"]["plain"]["overhead_p50_ratio"] == 1.0
    assert result["access"]["mtls"]["overhead_p50_ratio"] > 0
    assert "each against plain" in done.stdout


@pytest.mark.parametrize("flags, phrase", [
    (["--kv-budget", "12 parsecs"], "cannot read size '12 parsecs'"),
    (["--kv-budget", "1KiB"], "holds less than one block"),
    (["--max-step-tokens", "8"], "max_step_tokens (8) must hold a full draft + 1 (33)"),
])
def test_serve_explains_bad_kv_and_step_flags(pair, flags, phrase):
    done = sled("serve", "--model", str(pair[0]), "--port", str(free_port()), *flags)
    assert done.returncode == 2, done.stderr[-500:]
    assert phrase in done.stderr


async def test_generate_thin_device_and_lookahead_against_a_sat_target(pair, tmp_path, monkeypatch):
    """--drafter server / sat (no drafter on the device) and --lookahead: all the target's output."""
    from verify_server.sdsat import save_adapter

    monkeypatch.setenv("SLED_CACHE", str(tmp_path))
    target_dir, drafter_dir = pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    rows = model.get_input_embeddings()(torch.tensor([[11, 12, 13]]))[0].detach()
    adapter = save_adapter(tmp_path / "sat_adapter.safetensors", rows, {"base_model": "tiny"})
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer("class Session:").input_ids
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    async with ServerProcess(str(target_dir), "--dtype", "float64", "--sat-adapter", str(adapter)) as server:
        runs = {name: sled("generate", "--server", server.address, *flags, "--prompt", "class Session:",
                           "--max-new-tokens", "16", "--json")
                for name, flags in {"server": ["--drafter", "server"], "sat": ["--drafter", "sat"],
                                    "lookahead": ["--drafter", f"hf:{drafter_dir}", "--lookahead", "3"]}.items()}
    for name, done in runs.items():
        assert done.returncode == 0, (name, done.stderr[-800:])
        assert json.loads(done.stdout)["token_ids"] == reference, name
    assert json.loads(runs["sat"].stdout)["draft_tokens"] > 0      # SAT guesses were verified
