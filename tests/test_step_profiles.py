"""Step-cost profiles and the emulated server (`sled serve --emulate PROFILE`): the shipped
profile and its rule, the refusals, steps held to the profile's time, overruns counted, and the
output still the target's own."""
from __future__ import annotations

import asyncio
import json
import time
import types

import pytest

from conftest import greedy_reference, run_main
from verify_server.engines.emulated import EmulatedEngine
from verify_server.metrics import Metrics
from verify_server.step_costs import (StepCell, StepRule, load_profile, make_profile, parse_profile,
                                      shipped_profiles)

PROVENANCE = {"device": "a test GPU", "model": "tiny", "engine": "paged", "torch": "2.13",
              "transformers": "5.24", "date": "2026-11-27", "command": "made by the test"}


def profile_file(tmp_path, rule: dict, cells=None, provenance=PROVENANCE, name="test") -> str:
    cells = cells or [{"rows": 1, "tokens": 1, "context": 8, "ms": 1.0}]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"sled_step_profile": 1, "name": name, "provenance": provenance,
                                "cells": cells, "rule": rule}))
    return str(path)


def rows(*shape, kind=None):
    """Rows of (context, new tokens) as the pacer reads them: verify rows (decode for one
    token), or prefill or sat rows."""
    return [types.SimpleNamespace(kv=types.SimpleNamespace(length=c), width=w,
                                  want_logits=kind != "prefill", sat_slots=int(kind == "sat"))
            for c, w in shape]


class Stepless:
    """An engine whose forward takes no time."""
    kind, pool = "stepless", "its pool"

    def __init__(self):
        self.steps = []

    def forward(self, rows):
        self.steps.append(rows)
        return "its logits"


def test_an_emulated_engine_holds_each_forward_and_is_its_engine_otherwise(tmp_path):
    profile = load_profile(profile_file(tmp_path, {"base_ms": 30.0, "per_token_ms": 1.0,
                                                   "per_kv_token_ms": 0.1}))
    inner, metrics = Stepless(), Metrics()
    engine = EmulatedEngine(inner, profile, metrics)
    step = rows((100, 5), (40, 1))          # 50.6 ms on the profile's device
    started = time.perf_counter()
    assert engine.forward(step) == "its logits" and inner.steps == [step]
    assert 0.0506 <= time.perf_counter() - started < 0.0506 + 0.01
    assert metrics.emulated_steps._value.get() == 1
    assert (engine.kind, engine.pool) == ("stepless", "its pool")


def test_the_shipped_h100_profile_fits_its_measured_steps():
    assert "h100-llama8b-hf-graph" in shipped_profiles()
    profile = load_profile("h100-llama8b-hf-graph")
    assert len(profile.cells) == 10 and profile.worst_fit() < 0.06
    assert "H100" in profile.describe() and "not sled's engine" in profile.describe()
    # the rule of the module's example: 16 rows x 5 tokens at 512
    assert profile.step_seconds([(512, 5)] * 16) == pytest.approx(0.0175, abs=2e-4)
    # fitted from the cells again, the rule is the one the file holds
    assert StepRule.fit(profile.cells) == profile.rule


@pytest.mark.parametrize("name", ["h200-llama8b-flex-graph", "h200-gemma3-4b-flex-graph"])
def test_the_shipped_flex_profiles_hold_sleds_engine_measured_on_an_h200(name):
    profile = load_profile(name)
    assert name in shipped_profiles() and len(profile.cells) == 6 and profile.worst_fit() < 0.07
    assert "H200" in profile.describe() and "flex" in profile.describe()
    assert StepRule.fit(profile.cells) == profile.rule
    # nearly flat in the fleet: 64 sessions verifying 5 tokens each cost under 3x one session
    assert profile.step_seconds([(2048, 5)] * 64) < 3 * profile.step_seconds([(2048, 5)])


def test_a_fit_leaves_no_negative_term():
    """Steps that cost less with more KV would fit a negative per-KV term: it is left at 0."""
    cells = [StepCell(1, 1, 0, 10.0), StepCell(1, 1, 100, 10.0), StepCell(4, 1, 0, 12.0)]
    rule = StepRule.fit(cells)
    assert min(rule.base_ms, rule.per_token_ms, rule.per_kv_token_ms) >= 0
    assert rule.base_ms > 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("provenance"), "its provenance lacks device, model, engine"),
    (lambda d: d["provenance"].pop("command"), "its provenance lacks command"),
    (lambda d: d["cells"][0].update(ms=-2.0), "times must be positive"),
    (lambda d: d["cells"][0].update(ms=float("nan")), "times must be positive"),
    (lambda d: d.update(provenance="an H100"), "provenance must be a mapping"),
    (lambda d: d["cells"].append({"rows": 4, "tokens": 1, "context": 8, "ms": 0.5}),
     "not monotonic: 4 rows x 1 tokens at 8 (decode, 0.5 ms) is faster than the smaller 1 rows"),
    (lambda d: d["cells"][0].update(kind="draft"), "its kind is one of prefill, verify, decode"),
    (lambda d: d.update(rules={"draft": d["rule"]}), "a rule for 'draft', which is no kind"),
    (lambda d: d.update(floor={"bandwidth": 1e12}), "floor weight_bytes must be a positive"),
    (lambda d: d["rule"].update(per_token_ms=-0.1), "its rule has a negative term"),
    (lambda d: d.pop("sled_step_profile"), "not a sled step profile"),
    (lambda d: d.pop("rule"), "needs name, cells (rows, tokens, context, ms) and rule"),
])
def test_a_profile_that_cannot_stand_for_a_gpu_is_refused(tmp_path, change, message):
    data = json.loads(open(profile_file(tmp_path, {"base_ms": 1.0, "per_token_ms": 0.0,
                                                   "per_kv_token_ms": 0.0})).read())
    change(data)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_profile(data, "test")


def test_an_unknown_profile_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "serve", "--model", "m", "--emulate", "a100-nope")
    assert code == 2, err
    assert "unknown step profile 'a100-nope'" in err and "h100-llama8b-hf-graph" in err
    assert "Traceback" not in err
    bad = profile_file(tmp_path, {"base_ms": 1.0, "per_token_ms": 0.0, "per_kv_token_ms": 0.0},
                       provenance={"device": "x"})
    code, _, err = run_main(capsys, "serve", "--model", "m", "--emulate", bad)
    assert code == 2 and "its provenance lacks model" in err, err


def test_the_pacer_holds_a_step_to_the_profiles_time(tmp_path):
    profile = load_profile(profile_file(tmp_path, {"base_ms": 30.0, "per_token_ms": 1.0,
                                                   "per_kv_token_ms": 0.1}))
    metrics = Metrics()
    pacer = EmulatedEngine(Stepless(), profile, metrics)
    step = rows((100, 5), (40, 1))          # new 6, read 146: 30 + 6 + 14.6 = 50.6 ms
    started = time.perf_counter()
    pacer.hold(pacer.due(step, started))
    assert 0.0506 <= time.perf_counter() - started < 0.0506 + 0.01
    assert metrics.emulated_steps._value.get() == 1
    assert metrics.emulated_overruns._value.get() == 0
    # a step whose compute took longer than the profile allows is an overrun, not a wait
    started = time.perf_counter() - 0.2
    before = time.perf_counter()
    pacer.hold(pacer.due(step, started))
    assert time.perf_counter() - before < 0.005
    assert metrics.emulated_overruns._value.get() == 1
    assert metrics.emulated_overrun_seconds._value.get() == pytest.approx(0.149, abs=0.01)


def test_a_step_wider_than_the_measured_cells_is_said_once(tmp_path, caplog):
    profile = load_profile(profile_file(tmp_path, {"base_ms": 1.0, "per_token_ms": 0.0,
                                                   "per_kv_token_ms": 0.0}))   # cells: 1 row
    pacer = EmulatedEngine(Stepless(), profile, Metrics())
    pacer.due(rows((8, 1)), 0.0)
    assert "past the" not in caplog.text
    for _ in range(3):
        pacer.due(rows((8, 1), (8, 1), (8, 1)), 0.0)
    assert caplog.text.count("a step of 3 sessions is past the 1 the profile test measured") == 1


async def test_an_emulated_server_paces_its_steps_and_keeps_the_targets_output(
        serve, models, drafter_models, tokenizer, prompts, tmp_path):
    """Through the server: the greedy oracle holds, every step lasts the profile's time for
    its shape (this target computes faster), no step overruns."""
    from drafters.hf import HFDrafter
    from edge_client.session import RoundSettings, generate
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub

    model = models["llama"]
    # an 80 ms floor: a tiny step on a loaded 2-core machine stays well under it
    spec = profile_file(tmp_path, {"base_ms": 80.0, "per_token_ms": 0.5,
                                   "per_kv_token_ms": 0.01})
    server = await serve(model, emulate=spec)
    results = await asyncio.gather(*(
        generate(server_stub(server),
                 HFDrafter(drafter_models["llama"], tokenizer, name="hf:noisy"),
                 SessionRequest(prompt, max_new_tokens=12), settings=RoundSettings(draft_len=4))
        for prompt in prompts[:3]))
    for result, prompt in zip(results, prompts):
        assert result.token_ids == greedy_reference(model, prompt, 12)
    metrics = server.metrics
    steps = metrics.emulated_steps._value.get()
    assert steps == metrics.forward_passes._value.get() > 0
    assert metrics.emulated_overruns._value.get() == 0
    # every step took at least the profile's base, and not much more than its rule allows
    # (the largest step here: 3 prompts' prefill, under 200 tokens, under 190 ms)
    forward = metrics.forward_seconds.collect()[0].samples
    total = next(s.value for s in forward if s.name.endswith("_sum"))
    assert total / steps >= 0.080
    assert all(s.value == steps for s in forward
               if s.name.endswith("_bucket") and s.labels["le"] in ("0.25", "+Inf"))


def test_the_engine_bench_writes_a_profile_a_server_can_emulate(tmp_path, capsys):
    from sled_cli.main import main

    path = tmp_path / "cpu.json"
    assert main(["bench", "engine", "--shape", "tiny-llama", "--engines", "paged,flex",
                 "--sessions", "2", "--contexts", "32", "--reps", "1", "--out",
                 str(tmp_path / "engine.json"), "--write-profile", str(path)]) == 0
    profile = load_profile(str(path))
    assert profile.name == "cpu-tiny-llama-paged"
    assert [(c.rows, c.tokens, c.context) for c in profile.cells] == [(2, 5, 32)]
    assert profile.provenance["engine"] == "sled's paged engine"
    assert profile.provenance["command"].startswith("sled bench engine --shape tiny-llama")
    assert profile.worst_fit() < 1e-6
    code = main(["bench", "engine", "--shape", "tiny-llama,tiny-gemma3", "--write-profile",
                 str(path)])
    assert code == 2 and "a profile is one model's" in capsys.readouterr().err


def test_the_engine_bench_writes_the_floor_terms_and_a_kernel_breakdown(tmp_path, capsys):
    """The floor is verify_server.roofline's (streamed weights and the KV read over the
    bandwidth, the GEMMs' FLOPs over the peak, the larger of the two); --kernels on a CPU
    breaks each engine's step down by its operators."""
    from lab.bench.engine import KERNEL_COLUMNS
    from sled_cli.main import main
    from verify_server.shapes import kv_bytes_per_token, streamed_parameters

    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--shape", "tiny-llama", "--engines",
                 "paged,transformers-graph", "--sessions", "2", "--contexts", "32", "--reps", "1",
                 "--bandwidth", "2e10", "--peak-flops", "1e12", "--kernels",
                 "--out", str(out)]) == 0
    cell = json.loads(out.read_text())["models"][0]["cells"][0]
    streamed = streamed_parameters("tiny-llama")
    read = streamed * 4 + 2 * (32 + 5) * kv_bytes_per_token("tiny-llama", 4)     # float32
    assert cell["floor_bytes_ms"] == pytest.approx(read / 2e10 * 1e3)
    assert cell["floor_flops_ms"] == pytest.approx(2 * streamed * 2 * 5 / 1e12 * 1e3)
    assert cell["floor_ms"] == max(cell["floor_bytes_ms"], cell["floor_flops_ms"])
    assert cell["paged_over_floor"] == pytest.approx(cell["paged_ms_p50"] / cell["floor_ms"])
    for kind in ("paged", "transformers-graph"):
        kernels = cell[f"{kind}_kernels"]
        assert kernels["source"] == "cpu operators" and kernels["count"] > 0
        assert kernels["gemm_ms"] > 0
        assert sum(kernels[f"{c}_ms"] for c in KERNEL_COLUMNS) == pytest.approx(
            kernels["total_ms"], abs=1e-3)
    printed = capsys.readouterr().out
    assert "x floor" in printed and "kernels a server step" in printed


def test_kernels_are_told_apart_by_their_names():
    from lab.bench.engine import kernel_type

    assert [kernel_type(name) for name in (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "nvjet_tst_64x8_64x16",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64>",
        "void splitKreduce_kernel<32, 16, int, float>", "triton_tem_fused_flex_attention_0",
        "triton_poi_fused_add_mul_rsqrt_0", "triton_red_fused_argmax_1",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>",
        "Memcpy DtoH (Device -> Pinned)", "Memset (Device)", "aten::addmm", "aten::copy_",
        "aten::_scaled_dot_product_flash_attention_for_cpu", "cudaGraphLaunch")] == [
        "gemm", "gemm", "gemm", "gemm", "attention", "elementwise", "elementwise", "elementwise",
        "copies", "copies", "gemm", "copies", "attention", "other"]


def test_a_peak_of_no_flops_is_refused(capsys):
    code, _, err = run_main(capsys, "bench", "engine", "--shape", "tiny-llama", "--bandwidth",
                            "2e10", "--peak-flops", "0")
    assert code == 2 and "--peak-flops" in err


def test_a_profile_from_measured_cells_is_checked_like_a_shipped_one():
    cells = [StepCell(1, 5, 512, 10.0), StepCell(16, 5, 512, 9.0)]
    with pytest.raises(ValueError, match="not monotonic"):
        make_profile("noisy", PROVENANCE, cells)
    profile = make_profile("fine", PROVENANCE, [StepCell(1, 5, 512, 10.0),
                                                StepCell(16, 5, 512, 17.0),
                                                StepCell(16, 5, 2048, 35.0)])
    assert profile.worst_fit() < 0.01 and profile.rule.per_kv_token_ms > 0


def test_a_lab_scenario_names_the_profile_its_server_emulates(tmp_path):
    from pydantic import ValidationError

    from lab.scenario import Scenario

    fleet = [{"count": 1, "device": "pi5", "link": "wifi", "drafter": "ngram"}]
    base = {"name": "x", "target": "tiny", "requests": 1, "fleet": fleet}
    scenario = Scenario(**base, server={"args": ["--engine", "paged"],
                                        "emulate": "h100-llama8b-hf-graph"})
    assert scenario.server.flags == ["--engine", "paged", "--emulate", "h100-llama8b-hf-graph"]
    with pytest.raises(ValidationError, match="unknown step profile 'h200-dream'"):
        Scenario(**base, server={"emulate": "h200-dream"})
    copied = str(load_profile("h100-llama8b-hf-graph").save(tmp_path / "copy.json"))
    with pytest.raises(ValidationError, match="names a shipped profile"):   # not a host file
        Scenario(**base, server={"emulate": copied})


def test_an_accepted_share_becomes_the_per_position_acceptance_that_keeps_it():
    """The demo's emulated devices keep the share of their drafts the real drafters kept: a
    share of 0.6 of 4-token drafts needs each position accepted with about 0.81."""
    from lab.traces.synthetic import profile_for_share

    [a] = profile_for_share(0.6, 4)
    assert a == pytest.approx(0.806, abs=1e-3)
    assert sum(a ** j for j in range(1, 5)) / 4 == pytest.approx(0.6, abs=1e-3)
    assert profile_for_share(0.0, 4) == [0.0] and profile_for_share(1.0, 4) == [1.0]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        profile_for_share(1.5, 4)


# --- kinds of step, their rules, and the floor under them -----------------------------------------

def h200_llama8b_floor():
    from verify_server.roofline import GPUS, step_floor

    return step_floor("llama-8b", GPUS["H200"], "bfloat16", "bfloat16")


def measured_cells():
    """llama-8b on an H200 as sled's engine ran it (the shipped verify cells), with decode, SAT
    and prefill cells beside them: a prefill of 2,048 tokens at 60% of the bf16 peak."""
    verify = list(load_profile("h200-llama8b-sled-forward").cells)
    return verify + [
        StepCell(1, 1, 512, 7.1, "decode"), StepCell(64, 1, 2048, 19.0, "decode"),
        StepCell(1, 9, 512, 21.0, "sat"), StepCell(16, 9, 2048, 30.0, "sat"),
        StepCell(64, 9, 2048, 41.0, "sat"),
        StepCell(1, 512, 0, 16.5, "prefill"), StepCell(1, 2048, 0, 52.0, "prefill"),
        StepCell(4, 512, 0, 51.0, "prefill")]


def test_cells_carry_their_kind_and_each_kind_that_runs_apart_its_own_rule(tmp_path):
    profile = make_profile("kinds", PROVENANCE, measured_cells(), floor=h200_llama8b_floor())
    assert {c.kind for c in profile.cells} == {"prefill", "verify", "decode", "sat"}
    # verify and decode share the rule; prefill and sat have their own, with its KV term
    assert StepRule.fit([c for c in profile.cells if c.kind in ("verify", "decode")]) == \
        profile.rule
    assert set(profile.rules) == {"prefill", "sat"}
    assert all(r.per_kv_token_ms == profile.rule.per_kv_token_ms for r in profile.rules.values())
    # a step is charged by what its rows are: a prefill chunk by the prefill rule
    chunk = profile.step_seconds([(0, 2048, "prefill")])
    assert chunk == pytest.approx(profile.rules["prefill"].ms(2048, 2048) / 1e3, rel=1e-9)
    assert chunk > profile.step_seconds([(0, 2048, "verify")])
    assert profile.step_seconds([(512, 9, "sat")]) > profile.step_seconds([(512, 9)])
    assert profile.worst_fit() < 0.25
    again = load_profile(str(profile.save(tmp_path / "kinds.json")))
    assert again == profile and [c.kind for c in again.cells] == [c.kind for c in profile.cells]


def test_a_cell_that_names_no_kind_decodes_one_token_and_verifies_more(tmp_path):
    profile = load_profile(profile_file(tmp_path, {"base_ms": 1.0, "per_token_ms": 0.0,
                                                   "per_kv_token_ms": 0.0}, cells=[
        {"rows": 1, "tokens": 1, "context": 8, "ms": 1.0},
        {"rows": 1, "tokens": 5, "context": 8, "ms": 1.0}]))
    assert [c.kind for c in profile.cells] == ["decode", "verify"]
    assert profile.floor is None and not profile.rules
    # a decode step measured a little slower than a verify step of the same bucket is noise
    make_profile("same-bucket", PROVENANCE, [StepCell(1, 1, 512, 7.2), StepCell(1, 5, 512, 6.9)])


@pytest.mark.parametrize("cells", ["verify only", "every kind"])
def test_a_profile_never_charges_under_its_floor_for_a_prefill_chunk_of_any_length(cells):
    """Every chunk the server's step budget allows, alone, after context, and beside 64 verify
    rows: the charge is at least the roofline of that step on the profile's GPU."""
    from verify_server.settings import ServerSettings

    floor = h200_llama8b_floor()
    measured = measured_cells() if cells == "every kind" else \
        load_profile("h200-llama8b-sled-forward").cells
    profile = make_profile("floored", PROVENANCE, measured, floor=floor)
    for chunk in range(1, ServerSettings().max_step_tokens + 1):
        for context in (0, 512, 2048):
            for beside in ([], [(2048, 5, "verify")] * 64):
                shape = [(context, chunk, "prefill"), *beside]
                new = sum(n for _, n, _ in shape)
                read = sum(c + n for c, n, _ in shape)
                assert profile.step_seconds(shape) * 1e3 >= floor.ms(new, read) * (1 - 1e-12)
    # a 2,048-token chunk is compute-bound: 2 x 7.5e9 parameters x 2048 over 989 TFLOP/s
    assert floor.ms(2048, 2048) == pytest.approx(2 * 7.5049e9 * 2048 / 989.4e12 * 1e3, rel=1e-3)


def test_where_the_rules_fall_under_the_floor_the_profile_says_so():
    """The shipped sled-forward profile measured verify steps only: its rule charges long
    prefill chunks under what the GPU can do, so they are charged the floor, and it says so."""
    shipped = load_profile("h200-llama8b-sled-forward")
    assert shipped.floor == h200_llama8b_floor()
    [note] = shipped.floored
    assert note.startswith("prefill chunks of ") and note.endswith("-8192 tokens at no context")
    first = int(note.removeprefix("prefill chunks of ").split("-")[0])
    assert shipped.fitted_ms(first, first, ("prefill",)) < shipped.floor.ms(first, first)
    assert shipped.step_ms(first, first, ("prefill",)) == shipped.floor.ms(first, first)
    assert shipped.fitted_ms(first - 1, first - 1, ("prefill",)) >= \
        shipped.floor.ms(first - 1, first - 1)
    # with its prefill steps measured, the rules stay above the floor
    assert not make_profile("measured", PROVENANCE, measured_cells(),
                            floor=h200_llama8b_floor()).floored


def test_an_emulated_server_holds_a_prefill_chunk_to_the_prefill_rule(tmp_path):
    profile = make_profile("kinds", PROVENANCE, measured_cells(), floor=h200_llama8b_floor())
    pacer = EmulatedEngine(Stepless(), profile, Metrics())
    chunk = pacer.due(rows((0, 2048), kind="prefill"), 0.0)
    assert chunk == pytest.approx(profile.rules["prefill"].ms(2048, 2048) / 1e3)
    assert pacer.due(rows((512, 9), kind="sat"), 0.0) == \
        pytest.approx(profile.step_seconds([(512, 9, "sat")]))
    assert pacer.due(rows((0, 2048)), 0.0) < chunk          # the same shape, as a verify row


def test_the_engine_bench_times_every_kind_of_step_and_profiles_them(tmp_path, capsys):
    from sled_cli.main import main

    out, path = tmp_path / "engine.json", tmp_path / "profile.json"
    assert main(["bench", "engine", "--shape", "tiny-llama", "--engines", "paged",
                 "--kinds", "prefill,verify,decode,sat", "--prefill", "1x48,2x32",
                 "--sat-slots", "3", "--sessions", "2", "--contexts", "32", "--reps", "1",
                 "--bandwidth", "2e10", "--peak-flops", "1e12", "--kernels", "--out", str(out),
                 "--write-profile", str(path)]) == 0
    cells = json.loads(out.read_text())["models"][0]["cells"]
    assert [(c["kind"], c["sessions"], c["tokens"], c["context"]) for c in cells] == [
        ("prefill", 1, 48, 0), ("prefill", 2, 32, 0), ("verify", 2, 5, 32),
        ("decode", 2, 1, 32), ("sat", 2, 8, 32)]
    assert cells[-1]["sat_slots"] == 3 and cells[-1]["paged_emitted_agree"] == "2/2"
    assert all(c["paged_kernels"]["count"] > 0 and c["floor_ms"] > 0 for c in cells)
    profile = load_profile(str(path))
    assert [(c.kind, c.rows, c.tokens, c.context) for c in profile.cells] == \
        [(c["kind"], c["sessions"], c["tokens"], c["context"]) for c in cells]
    assert set(profile.rules) == {"prefill", "sat"} and profile.floor.bandwidth == 2e10
    assert "--kinds prefill,verify,decode,sat" in profile.provenance["command"]
    printed = capsys.readouterr().out
    assert "kernels a server step" in printed and "prefill" in printed and "sat" in printed


def test_a_profile_can_charge_its_prefill_as_another_does():
    """--prefill-profile: prefill chunks charged by the other profile's prefill rule (never
    under this one's own), every other step as before."""
    own, published = load_profile("h200-llama8b-sled-forward"), load_profile(
        "h200-llama8b-vllm-published")
    both = own.with_prefill_of(published)
    prefill = [(0, 2048, "prefill")]
    verify = [(2048, 5, "verify")] * 16
    assert both.step_seconds(prefill) == pytest.approx(
        max(published.step_seconds(prefill), own.step_seconds(prefill)), rel=0.02)
    assert both.step_seconds(prefill) > own.step_seconds(prefill) * 1.3   # sled's was the floor
    assert both.step_seconds(verify) == own.step_seconds(verify)
    assert both.name == "h200-llama8b-sled-forward+prefill-of-h200-llama8b-vllm-published"
    assert "h200-llama8b-vllm-published" in both.provenance["prefill"]
    assert published.with_prefill_of(published) is published
