"""What a profiled GPU holds: shapes weighed as transformers builds them, what a profile's gpu
block leaves out derived and said, and a server held to a profile admitting only the KV that GPU
would hold."""
from __future__ import annotations

import json

import grpc
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import run_main
from sled.v1 import verifier_pb2 as pb
from tests.test_step_profiles import profile_file
from verify_server.engines.blocks import KVShape
from verify_server.gpu_memory import UTILIZATION, describe, gpu_memory
from verify_server.shapes import SHAPES, kv_bytes_per_token, parameters
from verify_server.step_costs import load_profile

H100 = {"device": "NVIDIA H100 80GB HBM3", "model": "llama-8b (random bf16 weights)",
        "dtype": "bfloat16", "engine": "paged", "torch": "2.13", "transformers": "5.24",
        "date": "2026-11-27", "command": "made by the test"}
RULE = {"base_ms": 1.0, "per_token_ms": 0.0, "per_kv_token_ms": 0.0}


@pytest.mark.parametrize("name", SHAPES)
def test_a_shape_weighs_what_transformers_builds(name):
    kind, fields = SHAPES[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields),
                                                 dtype=torch.bfloat16)
    assert parameters(name) == sum(p.numel() for p in model.parameters())
    assert kv_bytes_per_token(name, 2) == KVShape.of(model).bytes_per_token


def test_a_profile_without_a_gpu_block_derives_it_and_says_so(tmp_path):
    profile = load_profile(profile_file(tmp_path, RULE, provenance=H100))
    gpu = gpu_memory(profile)
    assert gpu.derived == ("memory_bytes", "weight_bytes", "kv_bytes_per_token", "tdp_watts")
    assert gpu.memory_bytes == 81559 << 20 and gpu.tdp_watts == 700
    assert gpu.weight_bytes == 8030261248 * 2 and gpu.kv_bytes_per_token == 128 << 10
    # 0.9 x 85.5 GB - 16.1 GB of weights, at 128 KiB a token
    assert gpu.kv_tokens() == int((gpu.memory_bytes * UTILIZATION - gpu.weight_bytes) // (128 << 10))
    assert 460_000 < gpu.kv_tokens() < 470_000
    line = describe(profile, gpu)
    assert "\n" not in line and "derived from the device's name and the model's shape" in line


def test_what_the_gpu_block_gives_wins_over_what_is_derived(tmp_path):
    path = tmp_path / "given.json"
    data = json.loads(open(profile_file(tmp_path, RULE, provenance=H100)).read())
    path.write_text(json.dumps({**data, "gpu": {"memory_bytes": 40 << 30}}))
    gpu = gpu_memory(load_profile(str(path)))
    assert gpu.memory_bytes == 40 << 30 and "memory_bytes" not in gpu.derived
    assert gpu.derived == ("weight_bytes", "kv_bytes_per_token", "tdp_watts")
    for shipped in ("h100-llama8b-hf-graph", "h200-llama8b-flex-graph",
                    "h200-gemma3-4b-flex-graph"):
        assert gpu_memory(load_profile(shipped)).derived == ()       # they carry their GPU


def test_an_unknown_gpu_keeps_the_servers_own_budget(tmp_path):
    profile = load_profile(profile_file(tmp_path, RULE))            # "a test GPU", model "tiny"
    gpu = gpu_memory(profile)
    assert not gpu.known and gpu.kv_tokens() is None
    assert "the GPU's memory is unknown" in describe(profile, gpu)


@pytest.mark.parametrize("gpu, says", [({"memory_bytes": -1}, "gpu memory_bytes must be a positive"),
                                       ({"watts": 700}, "gpu has no field watts"),
                                       ({"tdp_watts": "700"}, "must be a positive number")])
def test_a_bad_gpu_block_is_refused_in_one_line(tmp_path, capsys, gpu, says):
    path = tmp_path / "bad.json"
    data = json.loads(open(profile_file(tmp_path, RULE, provenance=H100)).read())
    path.write_text(json.dumps({**data, "gpu": gpu}))
    with pytest.raises(ValueError, match=says):
        load_profile(str(path))
    code, _, err = run_main(capsys, "serve", "--model", "m", "--emulate", str(path))
    assert code == 2 and says in err and "Traceback" not in err


def test_weights_that_fill_the_gpu_and_a_second_kv_budget_are_refused(tmp_path, capsys):
    full = tmp_path / "full.json"
    data = json.loads(open(profile_file(tmp_path, RULE, provenance=H100)).read())
    full.write_text(json.dumps({**data, "gpu": {"memory_bytes": 16 << 30}}))
    code, _, err = run_main(capsys, "serve", "--model", "m", "--emulate", str(full))
    assert code == 2 and "leave no room for KV" in err
    code, _, err = run_main(capsys, "serve", "--model", "m", "--emulate", "h100-llama8b-hf-graph",
                            "--kv-budget", "1GiB")
    assert code == 2 and "leave out --kv-budget" in err


def small_gpu(tmp_path, tokens: int) -> str:
    """A profile whose GPU holds `tokens` tokens of KV after its weights."""
    path = tmp_path / "small.json"
    data = json.loads(open(profile_file(tmp_path, RULE)).read())
    kv, weights = 1000, 5000
    memory = -(-(tokens * kv + weights) * 10 // 9) + 1
    path.write_text(json.dumps({**data, "gpu": {"memory_bytes": memory, "weight_bytes": weights,
                                                "kv_bytes_per_token": kv}}))
    assert gpu_memory(load_profile(str(path))).kv_tokens() == tokens
    return str(path)


async def test_a_server_held_to_a_profile_admits_what_its_gpu_holds(serve, models, tmp_path):
    """The pool holds the profiled GPU's tokens of KV (whatever this target's KV per token): a
    second session past them is refused with REASON_KV_BUDGET, and admitted once the first ends."""
    from tests.test_lossless import server_stub

    server = await serve(models["llama"], emulate=small_gpu(tmp_path, 600), kv_budget=None,
                         kv_block_tokens=16, admission_queue=0)   # refused, not queued
    pool = server.scheduler.engine.pool
    assert 600 <= pool.capacity_tokens < 600 + 16
    stub = server_stub(server)

    async def opened():
        call = stub.Generate()
        await call.write(pb.DeviceMessage(open=pb.Open(
            prompt_ids=[5, 6, 7], max_new_tokens=400,
            tokenizer_fingerprint=server.service.core.target.fingerprint)))
        return await call.read(), call

    first, first_call = await opened()
    assert first.WhichOneof("kind") == "opened", first
    refused, call = await opened()
    assert refused.error.reason == pb.ErrorDetail.REASON_KV_BUDGET
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await first_call.done_writing()
    await first_call.code()
    second, call = await opened()
    assert second.WhichOneof("kind") == "opened"
    call.cancel()
