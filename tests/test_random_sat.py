"""`sled bench sdsat --sat-adapter random`: a SAT adapter of random weights for a target that has
none, of its shape and with the parts of the built-in adapter; a synthetic target (what the GPU
check serves) takes it; what the flags refuse."""
from __future__ import annotations

import pytest
import torch

from conftest import run_main
from lab.bench.random_sat import RANK, SLOTS, random_adapter_path, write_random_adapter
from verify_server.sat_lora import DEFAULT_MODULES
from verify_server.sdsat import adapter_metadata, load_adapter
from verify_server.target import Target


def test_a_random_adapter_fits_its_target_and_changes_no_standard_token(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_random_adapter(str(pair[0]), random_adapter_path(tmp_path / "sdsat.json"))
    assert path == tmp_path / "sdsat-random-sat.safetensors"
    spec = load_adapter(path)
    model = AutoModelForCausalLM.from_pretrained(pair[0])
    spec.check(model)       # every delta has its module's shape
    assert spec.kind == "lora" and spec.slots == SLOTS and spec.lora.rank == RANK
    layers = model.config.num_hidden_layers
    assert len(spec.lora.weights) == layers * len(DEFAULT_MODULES)
    assert all(not b.any() for _, b in spec.lora.weights.values())     # B starts at zero
    assert spec.embeddings.shape == (SLOTS, model.config.hidden_size)
    assert adapter_metadata(path)["mode"] == "random"
    # seeded: the same file again
    again = load_adapter(write_random_adapter(str(pair[0]), tmp_path / "again.safetensors"))
    assert torch.equal(again.embeddings, spec.embeddings)


def test_a_synthetic_target_serves_with_the_adapter_it_is_given(tmp_path, monkeypatch):
    from verify_server import synthetic

    monkeypatch.setitem(synthetic.SHAPES, "gemma3-test", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=16))
    path = write_random_adapter("synthetic:gemma3-test", tmp_path / "sat.safetensors")
    target = Target.load("synthetic:gemma3-test", dtype="float32", sat_adapter=str(path))
    assert target.sat is not None and target.sat_slots == SLOTS and target.sat.kind == "lora"
    target.sat.check(target.model)
    assert Target.load("synthetic:gemma3-test", dtype="float32").sat is None
    assert Target.load("synthetic:gemma3-test", dtype="float32", sat_adapter=str(path),
                       sat=False).sat is None


@pytest.mark.parametrize("flags, message", [
    (["--compare-adapter", "random"], "--compare-adapter random: compare a trained adapter"),
    (["--sat-adapter", "nowhere.safetensors"], "--sat-adapter nowhere.safetensors: no such file"),
])
def test_the_sdsat_bench_refuses_in_one_line(capsys, tmp_path, flags, message):
    code, _, err = run_main(capsys, "bench", "sdsat", "--workload", "tiny", "--drafters", "none",
                            "--out", str(tmp_path / "sdsat.json"), *flags)
    assert code == 2 and message in err and "Traceback" not in err, err
