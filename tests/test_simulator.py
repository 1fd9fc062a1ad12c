"""The fleet simulator (`sled lab simulate`): sled's own server core and device sessions on a
virtual clock, the engine replaced by a step-cost profile."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sled_cli.main import main
from verify_server import scheduler as scheduler_module
from verify_server.engines.blocks import BlockPool
from verify_server.step_costs import SHIPPED

SCENARIO = {
    "name": "simtest", "target": "tiny",
    "server": {"emulate": "h200-llama8b-flex-graph",
               "args": ["--max-batch-sessions", "256", "--max-sessions", "4096"]},
    "fleet": [{"count": 4, "device": "pi5", "link": "wifi", "drafter": "calibrated:smollm2-xtok"},
              {"count": 4, "device": "orin-nano", "link": "lte",
               "drafter": "calibrated:smollm2-xtok"}],
    "interleave": True, "fleet_sizes": [1, 8],
    "workload": {"source": "chat"}, "arrivals": {"mode": "closed"}, "requests": 1,
    "max_tokens": 16, "slo": {"tokens_per_s": 5.0, "ttft_s": 3.0}, "centralized": True,
}


def write_scenario(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, **changes}))
    return path


def simulate(tmp_path: Path, scenario: Path, *flags: str, out: str = "out") -> dict:
    """Run the command in this process; its results.json."""
    code = main(["lab", "simulate", str(scenario), "--context", "64", "--out",
                 str(tmp_path / out), *flags])
    assert code == 0
    return json.loads((tmp_path / out / "results.json").read_text())


def rows_of(results: dict) -> list[dict]:
    return results["results"]


def small_gpu_profile(tmp_path: Path, kv_tokens: int) -> Path:
    """The shipped flex profile on a GPU whose memory holds kv_tokens of KV after the weights."""
    data = json.loads((SHIPPED / "h200-llama8b-flex-graph.json").read_text())
    data["name"] = "small-gpu"
    data["gpu"] = {"memory_bytes": int((kv_tokens + 1) / 0.9) + 1, "weight_bytes": 1,
                   "kv_bytes_per_token": 1, "tdp_watts": 700.0}
    path = tmp_path / "small-gpu.json"
    path.write_text(json.dumps(data))
    return path


def test_every_output_is_its_script_in_both_modes(tmp_path):
    rows = rows_of(simulate(tmp_path, write_scenario(tmp_path)))
    assert [(r["mode"], r["devices"]) for r in rows] == [
        ("sled", 1), ("centralized", 1), ("sled", 8), ("centralized", 8)]
    for r in rows:
        assert r["mismatches"] == 0 and r["tokens"] == 16 * r["devices"]
        assert 0 < r["gpu_busy_share"] <= 1 and r["gpu_s_per_1k"] > 0
    sled = [r for r in rows if r["mode"] == "sled"]
    assert all(0 < r["acceptance_rate"] < 1 for r in sled)     # the calibrated pair drafts
    central = {r["devices"]: r for r in rows if r["mode"] == "centralized"}
    for r in sled:
        assert r["throughput_vs_centralized"] == r["throughput"] / central[r["devices"]]["throughput"]
        assert r["gpu_s_vs_centralized"] == r["gpu_s_per_1k"] / central[r["devices"]]["gpu_s_per_1k"]


def test_the_same_seed_gives_the_same_result(tmp_path):
    scenario = write_scenario(tmp_path)
    first = rows_of(simulate(tmp_path, scenario, "--seed", "3", out="a"))
    again = rows_of(simulate(tmp_path, scenario, "--seed", "3", out="b"))
    other = rows_of(simulate(tmp_path, scenario, "--seed", "4", out="c"))
    assert first == again
    assert first != other


def test_a_fleet_past_the_memory_wall_queues_and_never_overcommits(tmp_path, monkeypatch):
    """A GPU holding two sessions' KV (each reserves 64 + 16 tokens: 96 in blocks of 16): eight
    devices all finish and no reservation ever passes the pool. The server's admission queue
    holds the sessions that do not fit until KV is freed: none is refused, and the wait is in
    their time to first token. With --admission-queue 0 they are refused and ask again."""
    peaks = []
    reserve = BlockPool.reserve

    def watched(pool, blocks):
        reserve(pool, blocks)
        peaks.append((pool.committed_blocks, pool.usable_blocks))
    monkeypatch.setattr(BlockPool, "reserve", watched)
    scenario = write_scenario(tmp_path, fleet_sizes=[8])
    (tmp_path / "no-queue").mkdir()
    no_queue = write_scenario(tmp_path / "no-queue", fleet_sizes=[8], server={
        **SCENARIO["server"], "args": [*SCENARIO["server"]["args"], "--admission-queue", "0"]})
    small = str(small_gpu_profile(tmp_path, 2 * 96))
    roomy = rows_of(simulate(tmp_path, scenario, out="roomy"))
    queued = rows_of(simulate(tmp_path, scenario, "--profile", small, out="queued"))
    refused = rows_of(simulate(tmp_path, no_queue, "--profile", small, out="refused"))
    assert all(used <= usable for used, usable in peaks)
    for mode in ("sled", "centralized"):
        wide, waited, retried = (next(r for r in rows if r["mode"] == mode)
                                 for rows in (roomy, queued, refused))
        for walled in (waited, retried):
            assert walled["tokens"] == 8 * 16 and walled["mismatches"] == 0
            assert walled["ttft_ms_p95"] > wide["ttft_ms_p95"] + 200   # waited for KV
        assert wide["refused"] == waited["refused"] == 0 < retried["refused"]


def test_the_simulator_runs_the_servers_own_batching_policy(tmp_path, monkeypatch):
    """One session per step instead of every queued one: the same fleet takes far longer."""
    scenario = write_scenario(tmp_path, fleet_sizes=[8])
    batched = rows_of(simulate(tmp_path, scenario, "--modes", "centralized", out="batched"))
    plan = scheduler_module.Scheduler._plan

    def one_at_a_time(self, now):
        planned = plan(self, now)
        self._queue.extend(work for work, _ in planned[1:])
        return planned[:1]
    monkeypatch.setattr(scheduler_module.Scheduler, "_plan", one_at_a_time)
    single = rows_of(simulate(tmp_path, scenario, "--modes", "centralized", out="single"))
    assert single[0]["forward_passes"] > 4 * batched[0]["forward_passes"]
    assert single[0]["throughput"] < batched[0]["throughput"] / 2


def test_a_wrong_verdict_is_caught(tmp_path, monkeypatch):
    """The scripts are the oracle: a server that accepts every draft token gets exit 1."""
    from verify_server import acceptance

    def accept_all(targets, draft, loose=None, logits=None):
        return acceptance.Outcome(len(draft), [*draft, targets[len(draft)]])
    monkeypatch.setattr(acceptance, "greedy_chain", accept_all)
    code = main(["lab", "simulate", str(write_scenario(tmp_path, fleet_sizes=[1])), "--context",
                 "64", "--modes", "sled", "--out", str(tmp_path / "out")])
    assert code == 1


def test_a_profile_without_memory_fields_says_what_was_derived(tmp_path, capsys):
    data = json.loads((SHIPPED / "h100-llama8b-hf-graph.json").read_text())
    data.pop("gpu")
    data["name"] = "no-gpu-block"
    path = tmp_path / "no-gpu-block.json"
    path.write_text(json.dumps(data))
    simulate(tmp_path, write_scenario(tmp_path, fleet_sizes=[1]), "--profile", str(path),
             "--modes", "sled")
    said = capsys.readouterr().out
    assert "no-gpu-block: 85.5 GB, 16.06 GB of weights, 128 KiB of KV a token" in said
    assert "memory_bytes, weight_bytes, kv_bytes_per_token, tdp_watts derived" in said


@pytest.mark.parametrize("change, flags, says", [
    ({"fleet": "nope"}, [], "fleet"),
    ({}, ["--profile", "no-such-profile"], "no-such-profile"),
    ({"fleet": [{"count": 2, "device": "pi5", "link": "wifi", "drafter": "ngram"}],
      "fleet_sizes": [1, 2]}, [], "calibrated pairs only"),
    ({"server": {"args": []}}, [], "names no step-cost profile"),
    ({}, ["--fleet-sizes", "0,4"], "within 1..4096"),
    ({}, ["--fleet-sizes", "4097"], "within 1..4096"),
    ({}, ["--host-cost", "1"], "--host-cost takes STEP_MS,ROW_MS"),
    ({"requests": None, "duration_s": None}, [], "exactly one of requests and duration_s"),
    ({"server": {"emulate": "h200-llama8b-flex-graph", "args": ["--max-sessions", "x"]}}, [],
     "--max-sessions"),
])
def test_a_bad_scenario_flag_or_profile_is_one_line_and_exit_2(tmp_path, capsys, change, flags,
                                                                 says):
    code = main(["lab", "simulate", str(write_scenario(tmp_path, **change)), "--context", "64",
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("sled lab simulate: ") and says in err and "\n" not in err


def test_a_malformed_profile_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"sled_step_profile": 1, "name": "bad", "cells": "nope"}')
    code = main(["lab", "simulate", str(write_scenario(tmp_path)), "--profile", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("sled lab simulate: ") and "\n" not in err


def test_poisson_arrivals_are_seeded_per_device_and_queue_behind_a_busy_device(tmp_path):
    from lab.scenario import parse_scenario
    from lab.sim.simulate import arrivals

    scenario = parse_scenario({**SCENARIO, "requests": None, "duration_s": 20.0,
                               "arrivals": {"mode": "poisson", "rate_per_s": 2.0}})
    times = arrivals(scenario, 3, seed=0)
    assert times == arrivals(scenario, 3, seed=0) != arrivals(scenario, 4, seed=0)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 20.0
    assert 20 <= len(times) <= 60                               # about 2/s for 20 s
    # two requests a second of 16 tokens each: a Pi 5 drafting them cannot keep up, so later
    # requests wait behind earlier ones and their time to first token grows
    rows = rows_of(simulate(tmp_path, write_scenario(tmp_path, requests=None, duration_s=5.0,
                                                     fleet_sizes=[1], arrivals={
                                                         "mode": "poisson", "rate_per_s": 2.0})))
    sled = next(r for r in rows if r["mode"] == "sled")
    assert sled["mismatches"] == 0 and sled["tokens"] == 16 * len(arrivals(
        parse_scenario({**SCENARIO, "requests": None, "duration_s": 5.0,
                        "arrivals": {"mode": "poisson", "rate_per_s": 2.0}}), 0, seed=0))
    assert sled["ttft_ms_p95"] > max(1000.0, 1.5 * sled["ttft_ms_p50"])   # alone: about 350 ms


def test_the_hosts_own_time_slows_the_server_by_what_it_charges(tmp_path):
    """Charging 1 ms a step and 1 ms a session in it: the same fleet's steps take longer, and
    centralized (a step a token) loses more of its throughput than sled."""
    scenario = write_scenario(tmp_path, fleet_sizes=[8])
    free = {r["mode"]: r for r in rows_of(simulate(tmp_path, scenario, out="free"))}
    held = {r["mode"]: r for r in rows_of(simulate(tmp_path, scenario, "--host-cost", "1,1",
                                                   out="held"))}
    for mode in ("sled", "centralized"):
        assert held[mode]["throughput"] < free[mode]["throughput"]
        assert held[mode]["gpu_busy_share"] < free[mode]["gpu_busy_share"]   # idle meanwhile
    assert held["centralized"]["throughput"] / free["centralized"]["throughput"] < \
        held["sled"]["throughput"] / free["sled"]["throughput"]


def test_the_landscape_puts_runs_side_by_side(tmp_path, capsys):
    scenario = write_scenario(tmp_path)
    simulate(tmp_path, scenario, out="a")
    simulate(tmp_path, scenario, "--context", "256", out="b")
    capsys.readouterr()
    assert main(["lab", "landscape", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"),
                 "--out", str(tmp_path / "land.png")]) == 0
    said = capsys.readouterr().out
    assert "**h200-llama8b-flex-graph, 64 tokens, 16 new**: capacity sled 8+, centralized 8+" in said
    assert "**h200-llama8b-flex-graph, 256 tokens, 16 new**" in said
    assert (tmp_path / "land.png").stat().st_size > 10_000
    assert (tmp_path / "land-map.png").stat().st_size > 10_000    # the runs say their answer
    assert main(["lab", "landscape", str(scenario)]) == 2        # not a results file


def test_without_context_the_workload_is_counted_by_the_targets_tokenizer(tmp_path):
    """Prompts as the scenario's target tokenizes them (their ids, whatever their range, are in
    the simulated vocabulary), so their lengths are the workload's own."""
    from transformers import AutoTokenizer

    from lab.tiny import cached_pair
    from lab.workload import CHAT_PROMPTS

    scenario = write_scenario(tmp_path, fleet_sizes=[1])
    code = main(["lab", "simulate", str(scenario), "--modes", "sled", "--out", str(tmp_path / "o")])
    assert code == 0
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(cached_pair()[0])
    lengths = [len(tokenizer(text)["input_ids"]) for text in CHAT_PROMPTS]
    assert results["context_tokens"] == round(sum(lengths) / len(lengths))
    assert results["results"][0]["mismatches"] == 0


def test_bench_serves_sweep_on_the_simulator_is_lossless_and_says_its_ratios():
    """trace_sweep (`sled bench serve --simulate`, the demo's table): recorded-style traces on
    one server for the whole sweep, every output its trace's, sled's rows against centralized."""
    import random

    from edge_client.session import RoundSettings
    from lab.profiles import device_profile, link_profile
    from lab.sim.simulate import trace_sweep
    from lab.traces.format import TraceSet
    from lab.traces.synthetic import SyntheticDrafter, synthetic_trace_set
    from verify_server.step_costs import load_profile

    draw = random.Random(0)
    prompts = [[draw.randrange(1, 500) for _ in range(40)] for _ in range(3)]
    outputs = [[draw.randrange(1, 500) for _ in range(12)] for _ in prompts]
    traces = synthetic_trace_set(prompts, outputs, SyntheticDrafter([0.8], 8, 0, "test"), 500,
                                 "test", None)
    rows = trace_sweep(load_profile("h200-llama8b-flex-graph"), ["--max-streams-per-device", "64"],
                       TraceSet("test", "test", 8, traces.traces), [1, 4], ["sled", "centralized"],
                       device_profile("pi5"), link_profile("wifi"), RoundSettings(draft_len=4), 12)
    assert [(r["mode"], r["devices"]) for r in rows] == [
        ("sled", 1), ("centralized", 1), ("sled", 4), ("centralized", 4)]
    assert all(r["mismatches"] == 0 and r["tokens"] == 12 * r["devices"] for r in rows)
    assert all("throughput_vs_centralized" in r for r in rows if r["mode"] == "sled")


def test_the_landscape_sweeps_prompt_and_answer_lengths_into_one_map(tmp_path, capsys):
    """`sled lab landscape --sweep`: a run per prompt x answer length, every mode's outputs its
    scripts', each request its answer's length, the map and the heat map written; a flag that
    is the sweep's own is refused in one line."""
    scenario = write_scenario(tmp_path)
    runs, out = tmp_path / "runs", tmp_path / "landscape.png"
    code = main(["lab", "landscape", "--sweep", str(scenario), "--contexts", "64,128",
                 "--answers", "8,16", "--runs", str(runs), "--out", str(out), "--simulate-args",
                 "--fleet-sizes 1,2 --refine 0 --modes sled,centralized,centralized-spec"])
    assert code == 0
    for context in (64, 128):
        for answer in (8, 16):
            results = json.loads((runs / f"{context}-{answer}" / "results.json").read_text())
            assert results["max_tokens"] == answer and results["context_tokens"] == context
            rows = rows_of(results)
            assert {r["mode"] for r in rows} == {"sled", "centralized", "centralized-spec"}
            assert all(r["mismatches"] == 0 and r["tokens"] == answer * r["devices"]
                       for r in rows)
    assert out.stat().st_size > 0 and (tmp_path / "landscape-map.png").stat().st_size > 0
    capsys.readouterr()
    code = main(["lab", "landscape", "--sweep", str(scenario), "--runs", str(runs),
                 "--simulate-args", "--context 64"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--context" in err
