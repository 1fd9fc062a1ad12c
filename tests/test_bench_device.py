"""`sled bench device` as a person runs it, on a tiny random pair; and its bookkeeping on
hand-made numbers."""
from __future__ import annotations

import json

import pytest

from conftest import run_sled
from lab.bench import harness
from lab.bench.device import (Config, Samples, adaptive_rows, configurations, pipeline_rows,
                              rate, ratio_interval, rtt_link)


def sled(*args: str, timeout: float = 300):
    return run_sled(*args, timeout=timeout)


def test_bench_device_compares_draft_lengths_and_pipelining_losslessly(pair, tmp_path):
    target, drafter = map(str, pair)
    traces = tmp_path / "traces.jsonl"
    done = sled("trace", "record", "--model", target, "--drafter", f"hf:{drafter}", "--workload",
                "tiny", "--prompts", "2", "--max-new-tokens", "8", "--max-draft-len", "4", "--out", str(traces))
    assert done.returncode == 0, done.stderr
    assert "confidences" in traces.read_text().splitlines()[1]      # the hf drafter reports them

    out = tmp_path / "device.json"
    done = sled("bench", "device", "--traces", str(traces), "--max-new-tokens", "8",
                "--device-profile", "orin-nano", "--links", "ethernet,wifi", "--draft-lens", "1,2",
                "--rtts", "5,20", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = result["results"]
    assert len(rows) == 2 * 3 + 2 * 2
    assert all(r["mismatches"] == 0 and r["tokens"] > 0 and r["device_tps"] > 0 for r in rows)
    table = result["adaptive_vs_fixed"]
    assert [r["link"] for r in table] == ["ethernet", "wifi"]
    for r in table:
        assert set(r["fixed_tps"]) == {"1", "2"} and r["best_fixed_k"] in (1, 2)
        assert r["adaptive_vs_best_fixed"] == pytest.approx(r["adaptive_tps"] / r["best_fixed_tps"])
        assert 0 < r["ratio_ci95"][0] <= r["ratio_ci95"][1]
    piped = result["pipelining"]
    assert [(r["rtt_ms"], r["link"]) for r in piped] == [(5.0, "wifi:rtt_ms=5"), (20.0, "wifi:rtt_ms=20")]
    assert all(r["gain"] == pytest.approx(r["on_tps"] / r["off_tps"]) for r in piped)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "adaptive draft length vs fixed k" in done.stdout and "pipelined drafting" in done.stdout


def test_bench_device_refuses_bad_arguments(tmp_path):
    missing = str(tmp_path / "none.jsonl")
    done = sled("bench", "device", "--parts", "adaptive,magic", "--traces", missing)
    assert done.returncode == 2 and "--parts" in done.stderr
    done = sled("bench", "device", "--k", "0,2", "--traces", missing)
    assert done.returncode == 2 and "--k" in done.stderr
    done = sled("bench", "device", "--links", "ethernet,dialup", "--traces", missing)
    assert done.returncode == 2 and "unknown link profile" in done.stderr


def test_rtt_links_and_the_interleaved_order():
    assert rtt_link("wifi", 20) == "wifi:rtt_ms=20"
    assert rtt_link("lte:rtt_ms=80,jitter_ms=1", 5.5) == "lte:rtt_ms=5.5,jitter_ms=1"
    configs = configurations(["adaptive", "pipeline"], ["ethernet"], [1, 4], [5], "wifi", 4)
    assert [c.label for c in configs] == ["ethernet k=1", "ethernet k=4", "ethernet adaptive",
                                          "wifi:rtt_ms=5 k=4", "wifi:rtt_ms=5 k=4 pipelined"]
    orders = [harness.rotated(configs, u) for u in range(len(configs))]
    assert all(sorted(o, key=configs.index) == configs for o in orders)
    assert len({o[0] for o in orders}) == len(configs)        # each goes first once


def samples(config: Config, tokens: list[int], seconds: list[float]) -> Samples:
    return Samples(config, tokens, seconds)


def test_ratios_and_the_best_fixed_length():
    results = {c: samples(c, t, s) for c, t, s in (
        (Config("adaptive", "lte", 1), [10, 10], [2.0, 2.0]),
        (Config("adaptive", "lte", 4), [10, 10], [1.0, 1.0]),
        (Config("adaptive", "lte", "adaptive"), [10, 10], [0.8, 1.2]),
        (Config("pipeline", "wifi:rtt_ms=5", 4, False), [10, 10], [1.0, 1.0]),
        (Config("pipeline", "wifi:rtt_ms=5", 4, True), [10, 10], [0.5, 0.5]))}
    [row] = adaptive_rows(results, ["lte"], [1, 4])
    assert row["best_fixed_k"] == 4 and row["fixed_tps"] == {"1": 5.0, "4": 10.0}
    assert row["adaptive_vs_best_fixed"] == pytest.approx(1.0)
    assert row["ratio_ci95"][0] < 1.0 < row["ratio_ci95"][1]       # prompts disagree
    [piped] = pipeline_rows(results, "wifi", [5], 4)
    assert piped["gain"] == pytest.approx(2.0) and piped["gain_ci95"] == pytest.approx([2.0, 2.0])
    assert rate(results[Config("adaptive", "lte", 1)], [0]) == 5.0
    a, b = results[Config("adaptive", "lte", 4)], results[Config("adaptive", "lte", 1)]
    assert ratio_interval(a, b) == pytest.approx((2.0, 2.0))
