"""`sled bench sdsat` as a person runs it, on a tiny random pair with a hand-made SAT adapter; a
target without SATs is refused; and the benchmark's bookkeeping on hand-made results."""
from __future__ import annotations

import json

import pytest

from conftest import run_sled
from edge_client.result import GenerationResult
from lab.bench.sdsat import Run, chunks, ratio, summarize
from verify_server.sdsat import save_adapter


@pytest.fixture(scope="module")
def adapter(pair, tmp_path_factory):
    """Three SAT slots made of rows of the target's own input embeddings (untrained)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair[0])
    rows = target.get_input_embeddings().weight[[5, 17, 42]].detach()
    return save_adapter(tmp_path_factory.mktemp("sat") / "sat_adapter.safetensors", rows,
                        {"base_model": str(pair[0])})


@pytest.fixture(scope="module")
def lora_adapter(pair, tmp_path_factory):
    """The same slots with random SAT-only LoRA deltas: a second adapter to compare."""
    from transformers import AutoModelForCausalLM

    from test_sat_lora import random_lora

    target = AutoModelForCausalLM.from_pretrained(pair[0])
    rows = target.get_input_embeddings().weight[[5, 17, 42]].detach()
    return save_adapter(tmp_path_factory.mktemp("sat") / "sat_adapter.safetensors", rows,
                        {"base_model": str(pair[0])}, random_lora(target, scale=0.05))


def sled(*args: str, timeout: float = 300):
    return run_sled(*args, timeout=timeout)


def test_bench_sdsat_compares_self_drafting_and_lookahead_losslessly(pair, adapter, lora_adapter,
                                                                     tmp_path):
    target, drafter = map(str, pair)
    out = tmp_path / "sdsat.json"
    done = sled("bench", "sdsat", "--model", target, "--sat-adapter", str(lora_adapter),
                "--compare-adapter", str(adapter), "--workload", "tiny", "--drafters",
                f"ngram,hf:{drafter}", "--max-new-tokens", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["lossless"] and result["sat_slots"] == 3
    assert (result["sat_adapter"], result["compare_adapter"]) == (str(lora_adapter), str(adapter))
    plain, sat, sampled, compared = result["self_drafting"]["rows"]
    assert [r["mode"] for r in (plain, sat, sampled, compared)] == \
        ["plain", "sat", "sat sampled", "sat (compared adapter)"]
    assert plain["tokens"] == sat["tokens"] == compared["tokens"] > 0
    assert plain["lossless"] and sat["lossless"] and compared["lossless"]
    assert not sampled["compared"] and sampled["tokens"] > 0   # sampled: not compared
    assert plain["draft_tokens"] == 0 and sat["draft_tokens"] > 0   # SAT guesses were verified
    assert plain["per_slot_acceptance"] is None and len(sat["per_slot_acceptance"]) == 3
    assert plain["passes_per_token"] >= 1.0 and sat["passes_per_token"] > 0
    assert sat["passes_per_token_vs_plain"] == pytest.approx(sat["passes_per_token"]
                                                             / plain["passes_per_token"])
    part = result["lookahead"]
    assert (part["k"], part["lookahead"]) == (4, 3)
    rows = part["rows"]
    assert [(r["drafter"], r["lookahead"], r["hints"]) for r in rows] == [
        ("ngram", 0, "none"), ("ngram", 3, "measured"), ("ngram", 3, "always"),
        (f"hf:{drafter}", 0, "none"), (f"hf:{drafter}", 3, "measured"), (f"hf:{drafter}", 3, "always")]
    assert all(r["lossless"] and r["tokens"] == plain["tokens"] for r in rows)
    assert all(r["same_as_no_lookahead"] and r["tokens_per_round_vs_none"] > 0
               for r in rows if r["lookahead"])
    assert all(r["hint_tokens"] == 0 for r in rows if not r["lookahead"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "self-drafting" in done.stdout and "lookahead" in done.stdout


def test_bench_sdsat_refuses_a_target_without_sats(pair, tmp_path):
    done = sled("bench", "sdsat", "--model", str(pair[0]), "--workload", "tiny", "--drafters",
                "ngram", "--max-new-tokens", "4", "--out", str(tmp_path / "sdsat.json"))
    assert done.returncode == 2
    assert "has no SATs: pass --sat-adapter or train one with sled sdsat train" in done.stderr
    assert not (tmp_path / "sdsat.json").exists()


def test_bench_sdsat_refuses_bad_arguments(tmp_path):
    done = sled("bench", "sdsat", "--k", "0")
    assert done.returncode == 2 and "--k" in done.stderr
    done = sled("bench", "sdsat", "--sat-adapter", str(tmp_path / "none.safetensors"))
    assert done.returncode == 2 and "--sat-adapter" in done.stderr
    done = sled("bench", "sdsat", "--compare-adapter", str(tmp_path / "none.safetensors"))
    assert done.returncode == 2 and "--compare-adapter" in done.stderr and "no such file" in done.stderr


def result(tokens: list[int], rounds: int, drafted: int = 0, accepted: int = 0) -> GenerationResult:
    return GenerationResult(token_ids=tokens, finish_reason="length", rounds=rounds,
                            draft_tokens=drafted, accepted_tokens=accepted)


def test_summary_counts_steps_passes_and_mismatches():
    reference = {0: [1, 2, 3, 4], 1: [5, 6]}
    run = Run({0: result([1, 2, 3, 4], rounds=2, drafted=6, accepted=2),
               1: result([5, 7], rounds=1, drafted=2, accepted=1)}, passes=5, seconds=2.0)
    row = summarize(run, reference)
    assert (row["tokens"], row["rounds"]) == (6, 3)
    assert row["passes_per_token"] == pytest.approx(5 / 6)
    assert row["tokens_per_round"] == pytest.approx(2.0)
    assert row["accepted_per_round"] == pytest.approx(1.0)
    assert row["acceptance_rate"] == pytest.approx(3 / 8)
    assert row["tokens_per_s"] == pytest.approx(3.0)
    assert row["mismatched_prompts"] == [1] and not row["lossless"]
    plain = summarize(Run({0: result([1, 2, 3, 4], rounds=4)}, passes=5, seconds=1.0), reference)
    assert plain["acceptance_rate"] is None and plain["lossless"]


def test_per_slot_acceptance_is_conditional_on_the_slots_before():
    from lab.bench.sdsat import per_slot

    assert per_slot([(3, 1), (3, 3)], 3) == [1.0, 0.5, 1.0]
    assert per_slot([(2, 0), (0, 0)], 3) == [0.0, None, None]


def test_groups_rotate_the_order_of_the_modes():
    from lab.bench.harness import rotated

    assert [rotated(["a", "b", "c"], i) for i in range(4)] == \
        [["a", "b", "c"], ["b", "a", "c"], ["c", "a", "b"], ["a", "c", "b"]]
    assert [rotated(["sled", "centralized"], i) for i in range(2)] == \
        [["sled", "centralized"], ["centralized", "sled"]]


def test_chunks_and_ratio():
    assert chunks(5, 2) == [[0, 1], [2, 3], [4]]
    assert chunks(3, 8) == [[0, 1, 2]]
    assert ratio(3.0, 2.0) == pytest.approx(1.5)
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None
