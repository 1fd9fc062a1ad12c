"""PUBLISHED step-cost profiles: vLLM's and SGLang's published figures for Llama 3.1 8B as
profiles (`sled bench publish-profile`), on the H100 they were published for and moved to an H200
by its roofline; a published profile names its source or does not load; and no shipped profile
charges a prefill less than its FLOPs."""
from __future__ import annotations

import json

import pytest

from conftest import run_main
from lab.bench.publish import MODELS, SGLANG_KV_PER_ROW, SGLANG_POINTS, floor_on, published_profile
from verify_server.roofline import GPUS, gpu_spec
from verify_server.shapes import shape_of, streamed_parameters
from verify_server.step_costs import SHIPPED, load_profile, parse_profile

PUBLISHED = {"h100-llama8b-vllm-published": ("vllm", "H100"),
             "h200-llama8b-vllm-published": ("vllm", "H200"),
             "h100-llama8b-sglang-published": ("sglang", "H100"),
             "h200-llama8b-sglang-published": ("sglang", "H200")}


def test_a_published_profile_without_a_source_is_refused_in_one_line():
    data = json.loads((SHIPPED / "h100-llama8b-vllm-published.json").read_text())
    for source in (None, "", "  "):
        if source is None:
            data["provenance"].pop("source", None)
        else:
            data["provenance"]["source"] = source
        with pytest.raises(ValueError) as refused:
            parse_profile(data, "test")
        said = str(refused.value)
        assert "it says it is published but names no source" in said and "\n" not in said
    data["provenance"]["published"] = False            # a measured one needs no source
    assert parse_profile(data, "test").label == ""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_shipped_published_profile_loads_and_says_so(name):
    profile = load_profile(name)
    engine, gpu = PUBLISHED[name]
    assert profile.provenance["published"] is True and profile.provenance["source"].strip()
    assert gpu_spec(profile.provenance["device"]) == GPUS[gpu]
    if gpu == "H100":
        assert profile.describe().startswith(f"{name}: PUBLISHED: ")
        assert "DERIVED" not in profile.describe() and profile.title == f"{name} (PUBLISHED)"
    else:
        assert profile.describe().startswith(f"{name}: PUBLISHED, DERIVED for this GPU: ")
        assert "never measured" not in profile.describe()
        assert "No figure of this engine on an H200 is published" in profile.provenance["source"]
    assert ("SpecDecode-Bench" if engine == "vllm" else "sgl-project/sglang#1008") in \
        profile.provenance["source"]
    # what the command writes today is what ships
    assert published_profile(engine, gpu).cells == profile.cells
    # the grid of sled's measured profiles, every kind of step it charges
    assert {(c.kind, c.rows, c.tokens, c.context) for c in profile.cells} >= \
        {("prefill", 1, 2048, 0), ("prefill", 4, 512, 0), ("verify", 64, 5, 2048),
         ("decode", 16, 1, 512)}
    assert all(c.ms >= profile.floor.ms(c.new, c.read) for c in profile.cells)


@pytest.mark.parametrize("name", sorted(path.stem for path in SHIPPED.glob("*.json")))
def test_no_shipped_profile_charges_a_prefill_less_than_its_flops(name):
    """One row of 2,048 new tokens: at least 2 x streamed parameters x 2,048 at the GPU's dense
    peak in the weights' dtype (bf16; fp8 for an fp8 profile), whatever its rules say."""
    profile = load_profile(name)
    shape = shape_of(profile.provenance["model"])
    peak = gpu_spec(profile.provenance["device"]).flops[profile.provenance["dtype"]]
    flops_s = 2 * streamed_parameters(shape) * 2048 / peak
    assert profile.step_seconds([(0, 2048, "prefill")]) >= flops_s * (1 - 1e-9), name


def test_the_h100_vllm_profile_holds_the_published_fit():
    profile = load_profile("h100-llama8b-vllm-published")
    fit = 39.3e-9 * (1024 + 1) + 21e-6 * 1 + 5.89e-3 + 1.2e-3
    floor = profile.floor.ms(1, 1025) / 1e3
    assert profile.step_seconds([(1024, 1)]) == pytest.approx(max(fit, floor), rel=0.02)
    # and where the fit is far from one row: 64 rows verifying 5 tokens at 2k
    fit = 39.3e-9 * 64 * 2053 + 21e-6 * 320 + 5.89e-3 + 1.2e-3
    assert profile.step_seconds([(2048, 5)] * 64) == pytest.approx(fit, rel=0.02)


def test_the_sglang_profile_passes_through_its_two_published_steps():
    profile = load_profile("h100-llama8b-sglang-published")
    for rows, seconds in SGLANG_POINTS:
        step = [(SGLANG_KV_PER_ROW - 1, 1)] * rows
        assert profile.step_seconds(step) == pytest.approx(seconds, rel=0.01)
    assert MODELS["sglang"].per_kv_token_s == MODELS["vllm"].per_kv_token_s


@pytest.mark.parametrize("engine", sorted(MODELS))
def test_on_an_h200_each_cell_keeps_its_h100_distance_from_the_roofline(engine):
    h100, h200 = published_profile(engine, "H100"), published_profile(engine, "H200")
    assert h200.provenance["derived"] is True and "derived" not in h100.provenance
    for there, here in zip(h100.cells, h200.cells):
        ratio = there.ms / floor_on(GPUS["H100"]).ms(there.new, there.read)
        assert here.ms == pytest.approx(ratio * floor_on(GPUS["H200"]).ms(here.new, here.read),
                                        rel=1e-3, abs=1e-3)
        assert here.ms <= there.ms                       # the H200 is never the slower
    # a prefill chunk is bound by FLOPs on both, and the two have the same bf16 peak
    assert [c.ms for c in h200.cells if c.kind == "prefill"] == \
        [c.ms for c in h100.cells if c.kind == "prefill"]


def test_the_command_writes_a_loadable_profile_and_refuses_in_one_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    code, said, err = run_main(capsys, "bench", "publish-profile", "--engine", "sglang", "--gpu",
                               "H200", "--out", str(out))
    assert code == 0, err
    assert "PUBLISHED, DERIVED for this GPU" in said
    assert load_profile(str(out)).cells == load_profile("h200-llama8b-sglang-published").cells
    for flag, value in (("--gpu", "A100"), ("--engine", "trt-llm")):
        flags = {"--engine": "vllm", "--gpu": "H100", flag: value}
        words = [word for pair in flags.items() for word in pair]
        code, _, err = run_main(capsys, "bench", "publish-profile", *words, "--out", str(out))
        errors = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
        assert code == 2, err
        assert len(errors) == 1 and flag in errors[0] and repr(value) in errors[0], err
    # called directly, the same refusals in one line
    for engine, gpu, wanted in (("vllm", "A100", "no data sheet for GPU 'A100'"),
                                ("trt-llm", "H100", "no published figures for engine 'trt-llm'")):
        with pytest.raises(ValueError, match=wanted):
            published_profile(engine, gpu)
