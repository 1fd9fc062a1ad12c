"""`sled trace record` and `sled bench serve` as a person runs them, on a tiny random pair; and
the benchmark's metrics on hand-made numbers."""
from __future__ import annotations

import json

import pytest

from conftest import run_sled
from lab.traces import TraceSet
from lab.bench.serve import capacity
from lab.fleet_metrics import add_ratios, tpot_samples


def sled(*args: str, timeout: float = 300):
    return run_sled(*args, timeout=timeout)


def test_trace_record_then_bench_serve_compares_both_modes(pair, tmp_path):
    target, drafter = map(str, pair)
    traces_file = tmp_path / "traces.jsonl"
    done = sled("trace", "record", "--model", target, "--drafter", f"hf:{drafter}", "--workload",
                "tiny", "--prompts", "3", "--max-new-tokens", "8", "--max-draft-len", "4",
                "--out", str(traces_file))
    assert done.returncode == 0, done.stderr
    traces = TraceSet.load(traces_file)
    assert (traces.target, traces.drafter, traces.max_draft_len) == (target, f"hf:{drafter}", 4)
    assert len(traces.traces) == 3 and all(1 <= len(t.target_ids) <= 8 for t in traces.traces)

    out = tmp_path / "serve.json"
    done = sled("bench", "serve", "--traces", str(traces_file), "--devices", "1,2",
                "--max-new-tokens", "8", "--device-profile", "orin-nano", "--link", "ethernet",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [(r["mode"], r["devices"]) for r in rows] == \
        [("sled", 1), ("centralized", 1), ("sled", 2), ("centralized", 2)]
    assert all(r["mismatches"] == 0 and r["throughput"] > 0 for r in rows)
    assert all(r["device_tps_p5"] <= r["device_tps_p50"] <= r["device_tps_p95"] for r in rows)
    assert all(r["passes_per_token"] > 0 for r in rows)
    assert all(r["throughput_vs_centralized"] > 0 for r in rows if r["mode"] == "sled")
    # every sled draft was paced to the board (late or not); centralized devices draft nothing
    assert all(0 <= r["late_drafts"] <= r["paced_drafts"] for r in rows)
    assert all((r["paced_drafts"] > 0) == (r["mode"] == "sled") for r in rows)
    assert set(result["capacity"]) >= {"sled", "centralized", "ratio"}
    assert out.with_suffix(".png").stat().st_size > 0
    assert "capacity" in done.stdout and "lossless" in done.stdout

    # the same fleet against a server held to a 60 ms step: centralized serving makes one token
    # per device per step, so its devices get at most 1 / 60 ms each
    from tests.test_step_profiles import profile_file

    profile = profile_file(tmp_path, {"base_ms": 60.0, "per_token_ms": 0.0,
                                      "per_kv_token_ms": 0.0}, name="slow-gpu")
    done = sled("bench", "serve", "--traces", str(traces_file), "--devices", "2",
                "--max-new-tokens", "8", "--device-profile", "orin-nano", "--link", "ethernet",
                "--emulate", profile, "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    emulated = result["emulated"]
    assert emulated["profile"] == "slow-gpu" and emulated["provenance"]["device"] == "a test GPU"
    assert emulated["steps"] > 0 and emulated["overruns"] == 0 and emulated["valid"]
    central = next(r for r in result["results"] if r["mode"] == "centralized")
    assert central["mismatches"] == 0 and central["device_tps_p95"] <= 1 / 0.060
    assert "emulating slow-gpu" in done.stdout and "overruns: 0 of" in done.stdout


def test_bench_serve_refuses_bad_arguments(tmp_path):
    done = sled("bench", "serve", "--devices", "0", "--traces", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2 and "--devices" in done.stderr
    done = sled("bench", "serve", "--modes", "sled,magic")
    assert done.returncode == 2 and "--modes" in done.stderr
    done = sled("bench", "serve", "--emulate", "tpu-v9")
    assert done.returncode == 2 and "unknown step profile 'tpu-v9'" in done.stderr


def test_tpot_splits_a_verdicts_gap_over_its_tokens():
    assert tpot_samples([0.1, 0.3, 0.3, 0.4]) == pytest.approx([0.1, 0.1, 0.1])
    assert tpot_samples([0.5]) == []
    assert tpot_samples([0.2, 0.2, 0.5]) == pytest.approx([0.3])


def test_capacity_is_the_largest_fleet_that_keeps_the_slowest_devices_at_rate():
    rows = [{"mode": "sled", "devices": n, "device_tps_p5": rate, "throughput": n * rate}
            for n, rate in ((1, 40), (4, 30), (16, 12), (64, 4))]
    rows += [{"mode": "centralized", "devices": n, "device_tps_p5": rate, "throughput": n * rate}
             for n, rate in ((1, 50), (4, 20), (16, 6), (64, 1))]
    assert capacity(rows, "sled", 10) == 16
    assert capacity(rows, "centralized", 10) == 4
    assert capacity(rows, "centralized", 100) == 0
    add_ratios(rows)
    assert rows[2]["throughput_vs_centralized"] == pytest.approx(12 / 6)
    assert "throughput_vs_centralized" not in rows[4]
