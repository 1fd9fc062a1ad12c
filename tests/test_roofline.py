"""DERIVED step-cost profiles: a shape's roofline on a GPU's published figures, scaled by what a
profile measured on that GPU stands from its own."""
from __future__ import annotations

import pytest

from sled_cli.main import main
from verify_server.gpu_memory import gpu_memory
from verify_server.roofline import GPUS, derive_profile, roofline_ms
from verify_server.shapes import parameters, streamed_parameters
from verify_server.step_costs import load_profile

FLEX = "h200-llama8b-flex-graph"


def test_the_roofline_streams_weights_at_one_row_and_is_compute_bound_at_many():
    h200 = GPUS["H200"]
    streamed = streamed_parameters("llama-8b")
    assert streamed == parameters("llama-8b") - 128256 * 4096          # the input table stays
    one = roofline_ms("llama-8b", h200, "bfloat16", "bfloat16", new=5, read=517)
    assert one == pytest.approx(1e3 * (streamed * 2 + 517 * 131072) / 4.8e12)
    many = roofline_ms("llama-8b", h200, "bfloat16", "bfloat16", new=320, read=64 * 517)
    assert many == pytest.approx(1e3 * 2 * streamed * 320 / 989.4e12)   # its GEMMs, not its bytes
    assert many > 1e3 * (streamed * 2 + 64 * 517 * 131072) / 4.8e12


def test_deriving_the_measured_shape_gives_back_the_measured_cells():
    measured = load_profile(FLEX)
    again = derive_profile("llama-8b", "H200", measured)
    assert [(c.rows, c.tokens, c.context) for c in again.cells] == \
        [(c.rows, c.tokens, c.context) for c in measured.cells]
    assert [c.ms for c in again.cells] == pytest.approx([c.ms for c in measured.cells], abs=1e-3)


def test_a_bigger_target_costs_what_its_roofline_says_at_the_same_distance():
    measured = load_profile(FLEX)
    derived = derive_profile("llama-70b", "H200", measured, weight_dtype="float8")
    h200 = GPUS["H200"]
    for mine, theirs in zip(derived.cells, measured.cells):
        ratio = theirs.ms / roofline_ms("llama-8b", h200, "bfloat16", "bfloat16", theirs.new,
                                        theirs.read)
        floor = roofline_ms("llama-70b", h200, "float8", "bfloat16", mine.new, mine.read)
        assert mine.ms == pytest.approx(ratio * floor, rel=1e-3)
    gpu = gpu_memory(derived)
    assert gpu.weight_bytes == parameters("llama-70b")           # one byte a weight
    assert gpu.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2        # bf16 KV
    assert 150_000 < gpu.kv_tokens() < 250_000


def test_a_derived_profile_says_so_wherever_it_is_described():
    shipped = load_profile("derived-h200-llama70b-fp8")
    assert shipped.describe().startswith("derived-h200-llama70b-fp8: DERIVED, never measured: ")
    assert shipped.provenance["derived"] is True
    assert "DERIVED" not in load_profile(FLEX).describe()


def test_a_measurement_from_another_gpu_is_refused():
    with pytest.raises(ValueError, match="measured on NVIDIA H100 80GB HBM3, not an H200"):
        derive_profile("llama-70b", "H200", load_profile("h100-llama8b-hf-graph"))


def test_the_command_writes_a_loadable_profile_and_refuses_in_one_line(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "derive-profile", "--shape", "llama-70b", "--gpu", "H200",
                 "--measured", FLEX, "--weight-dtype", "float8", "--out", str(out)]) == 0
    assert load_profile(str(out)).cells == load_profile("derived-h200-llama70b-fp8").cells
    capsys.readouterr()
    assert main(["bench", "derive-profile", "--shape", "llama-70b", "--gpu", "H100",
                 "--measured", FLEX, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sled bench derive-profile: ") and "\n" not in err


def test_every_shipped_profile_carries_the_floor_of_its_gpu_and_shape():
    """The floor block of a measured profile is its GPU's data sheet under its model's shape
    (floor_of); a derived one carries its own target's: the 70B's fp8 weights over bf16 KV, and
    the published figures moved to an H200 the 8B's in bf16 there."""
    from verify_server.roofline import floor_of, step_floor
    from verify_server.step_costs import shipped_profiles

    h200_8b = step_floor("llama-8b", GPUS["H200"], "bfloat16", "bfloat16")
    derived_floors = {"derived-h200-llama70b-fp8": step_floor("llama-70b", GPUS["H200"], "float8",
                                                              "bfloat16"),
                      "h200-llama8b-vllm-published": h200_8b,
                      "h200-llama8b-sglang-published": h200_8b}
    for name in shipped_profiles():
        profile = load_profile(name)
        assert profile.floor is not None, name
        assert profile.floor == (floor_of(profile.provenance) or derived_floors[name]), name
        # every measured step stands above its floor
        assert all(c.ms > profile.floor.ms(c.new, c.read) for c in profile.cells), name
    derived = derive_profile("llama-70b", "H200", load_profile(FLEX), weight_dtype="float8")
    assert derived.floor == step_floor("llama-70b", GPUS["H200"], "float8", "bfloat16")
    assert derived.floor.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert [c.kind for c in derived.cells] == [c.kind for c in load_profile(FLEX).cells]
