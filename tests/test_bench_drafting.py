"""`sled bench drafting` and `sled bench loose` as a person runs them, on the tiny random pair,
and HumanEval's sandboxed functional check that the second one reports."""
from __future__ import annotations

import json

import pytest

from conftest import run_sled
from lab.humaneval import check_completions, cut_completion, problems


def test_bench_drafting_runs_every_drafter_as_chains_and_trees_losslessly(pair, tmp_path):
    target, drafter = map(str, pair)
    out = tmp_path / "drafting.json"
    done = run_sled("bench", "drafting", "--model", target, "--drafters",
                    f"ngram,cacheback,hf:{drafter}", "--workloads", "tiny", "--max-new-tokens", "12",
                    "--draft-len", "3", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["lossless"] and (result["device"], result["link"]) == ("pi5", "wifi")
    rows = result["results"]
    assert [r["name"] for r in rows] == ["ngram", "cacheback", "cacheback tree=2",
                                         f"hf:{drafter.rsplit('/', 1)[-1]}",
                                         f"hf:{drafter.rsplit('/', 1)[-1]} tree=2"]
    assert len({r["tokens"] for r in rows}) == 1 and rows[0]["tokens"] > 0   # the same outputs
    for r in rows:
        assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["tokens_per_round"] >= 1.0
        # a pi5 core is slower than one here, and every round pays the board's overhead
        assert r["draft_ms_per_token_board"] > r["draft_ms_per_token_host"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_loose_reports_pass_at_1_and_tokens_per_pass_per_mode(pair, tmp_path):
    target, drafter = map(str, pair)
    out = tmp_path / "loose.json"
    done = run_sled("bench", "loose", "--model", target, "--drafter", f"hf:{drafter}", "--loose",
                    "1:0.05", "--problems", "2", "--max-new-tokens", "8", "--out", str(out),
                    timeout=300)
    assert done.returncode == 0, done.stderr
    lossless, loose = json.loads(out.read_text())["results"]
    assert (lossless["mode"], loose["mode"]) == ("lossless", "loose 1:0.05")
    assert lossless["kept_loosely"] == 0 and lossless["differ_from_lossless"] == 0
    assert loose["kept_loosely"] > 0          # the tiny target is unsure almost everywhere
    for row in (lossless, loose):
        assert row["problems"] == 2 and 0.0 <= row["pass_at_1"] <= 1.0
        assert row["tokens_per_pass"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_bad_loose_setting_is_exit_2(pair):
    done = run_sled("bench", "loose", "--model", str(pair[0]), "--loose", "0:0.5", timeout=120)
    assert done.returncode == 2 and "window must be 1 to 16" in done.stderr


def test_humaneval_check_passes_the_canonical_solution_and_fails_wrong_or_endless_ones():
    first = problems(1)[0]
    checked = check_completions([(first["task_id"], first["canonical_solution"]),
                                 (first["task_id"], "    return None\n"),
                                 (first["task_id"], "    while True:\n        pass\n")],
                                timeout_s=1.0)
    assert [c["passed"] for c in checked] == [True, False, False]
    assert checked[2]["result"] == "timed out"


@pytest.mark.parametrize("text,body", [
    ("    return a + b\n\ndef other():\n    pass\n", "    return a + b\n"),
    ("    return a\nif __name__ == '__main__':\n    print(1)", "    return a"),
    ("    x = 1\n    return x", "    x = 1\n    return x"),
])
def test_a_completion_ends_at_the_next_top_level_statement(text, body):
    assert cut_completion(text) == body
