"""SAT LoRA adapters: deltas that act only at SAT slots leave every real token's logits bit-identical,
the engine's masked deltas equal peft's reference forward, the adapter file round-trips, and
self-drafting with one stays the target's output (greedy under concurrency and stop ids,
sampled in distribution)."""
from __future__ import annotations

import asyncio
import copy
import math

import grpc
import pytest
import torch

from conftest import greedy_reference
from lab.tiny import make_model
from sled.sampling import Sampling
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from test_sampling_e2e import exact_distributions, total_variation
from test_sdsat_serving import SLOTS, adapter_spec, server_sat
from verify_server.engine import Row, make_engine
from verify_server.sat_lora import SatLora, peft_config, to_peft
from verify_server.sdsat import SatSpec, load_adapter, save_adapter


def random_lora(model, seed: int = 0, scale: float = 0.3, rank: int = 4) -> SatLora:
    """Deltas on every projection, large enough to change the SAT slots' outputs a lot."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in peft_config(rank, 8).target_modules:
            a = torch.randn(rank, module.in_features, generator=generator, dtype=torch.float64)
            b = torch.randn(module.out_features, rank, generator=generator, dtype=torch.float64)
            weights[path] = ((a * scale).to(module.weight.dtype), (b * scale).to(module.weight.dtype))
    return SatLora(rank, 8.0, weights)


def lora_spec(model, seed: int = 0) -> SatSpec:
    return SatSpec(slots=SLOTS, embeddings=adapter_spec(model, seed).embeddings,
                   lora=random_lora(model, seed))


def rows_of(engine, prompts, sat_slots: int) -> list[Row]:
    """One row per prompt: its tokens (prefill and last token at once) then sat_slots SATs."""
    return [Row(engine.new_kv(), p, True, sat_slots) for p in prompts]


def engine_logits(model, spec: SatSpec | None, prompts, kind: str, sat_slots: int = SLOTS):
    engine = make_engine(model, kv_budget_bytes=8 << 20, kind=kind, sat=spec)
    rows = rows_of(engine, prompts, sat_slots)
    for row in rows:
        row.kv.admit([], row.width, b"")
    return engine.forward(rows)


@pytest.fixture(scope="module")
def gemma_f32(models):
    return copy.deepcopy(models["gemma3"]).to(torch.float32)


@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_real_token_logits_are_bit_identical_with_and_without_the_deltas(gemma_f32, prompts, kind):
    """float32, one packed forward mixing three sessions' real tokens and SAT slots: every
    real token's logits are equal bit for bit; the SAT slots' are not (the deltas act there)."""
    model = copy.deepcopy(gemma_f32)
    spec = lora_spec(model)
    plain = SatSpec(slots=SLOTS, embeddings=spec.embeddings)
    with_deltas = engine_logits(model, spec, prompts[:3], kind)
    without = engine_logits(copy.deepcopy(gemma_f32), plain, prompts[:3], kind)
    for prompt, got, want in zip(prompts, with_deltas, without):
        real = len(prompt)
        assert torch.equal(got[:real], want[:real])
        assert not torch.allclose(got[real:], want[real:], atol=1e-3)


@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_engine_sat_outputs_equal_pefts_reference_forward(gemma_f32, prompts, kind):
    """The engine's SAT-slot logits (three sessions in one pass) equal peft's: the prompt through
    the LoRA model with the adapter disabled, then the slots with it enabled."""
    spec = lora_spec(copy.deepcopy(gemma_f32), seed=2)
    got = engine_logits(copy.deepcopy(gemma_f32), spec, prompts[:3], kind)
    reference = to_peft(copy.deepcopy(gemma_f32), spec.lora).eval()
    for prompt, logits in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            with reference.disable_adapter():
                out = reference(input_ids=ids, use_cache=True)
            slots = reference(inputs_embeds=spec.embeddings[None].float(),
                              past_key_values=out.past_key_values, use_cache=True,
                              position_ids=torch.arange(len(prompt), len(prompt) + SLOTS)[None])
        torch.testing.assert_close(logits[:len(prompt)], out.logits[0].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[len(prompt):], slots.logits[0].float(), rtol=1e-4, atol=1e-4)


def test_the_adapter_file_round_trips_and_refuses_another_model(gemma_f32, tmp_path):
    spec = lora_spec(gemma_f32, seed=4)
    path = save_adapter(tmp_path / "sat_adapter.safetensors", spec.embeddings, {"base_model": "tiny"},
                        spec.lora)
    loaded = load_adapter(path)
    assert loaded.kind == "lora" and loaded.lora.rank == 4 and loaded.lora.alpha == 8.0
    assert loaded.lora.weights.keys() == spec.lora.weights.keys()
    for name, (a, b) in spec.lora.weights.items():   # stored as float16
        torch.testing.assert_close(loaded.lora.weights[name][0], a.float(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(loaded.lora.weights[name][1], b.float(), rtol=1e-3, atol=1e-3)
    loaded.check(gemma_f32)
    shallow = make_model("gemma3", gemma_f32.config.vocab_size, layers=1)
    with pytest.raises(ValueError, match="layers.1.*trained for another model"):
        loaded.check(shallow)        # its second layer's projections are not there
    narrow = make_model("gemma3", gemma_f32.config.vocab_size, hidden=32)
    with pytest.raises(ValueError, match="delta for model.layers.0.* is .* the layer is"):
        loaded.lora.check(narrow)   # (the spec refuses its embeddings first)


def test_outside_an_engine_pass_the_deltas_do_nothing(gemma_f32, prompts):
    """The same model object still generates as the plain target once an engine attached deltas."""
    model = copy.deepcopy(gemma_f32)
    want = greedy_reference(model, prompts[0], 8)
    make_engine(model, kv_budget_bytes=1 << 20, sat=lora_spec(model))
    assert greedy_reference(model, prompts[0], 8) == want


async def test_lora_self_drafting_matches_generate_under_concurrency_and_stop_ids(
        serve, models, tokenizer, prompts):
    model = copy.deepcopy(models["gemma3"])
    server = await serve(model, sat=lora_spec(model, seed=5))
    wants = [greedy_reference(model, p, 24) for p in prompts[:6]]
    stop = wants[0][10]
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = VerifierStub(channel)
        outs = await asyncio.gather(*(server_sat(stub, p, 24) for p in prompts[:6]),
                                    server_sat(stub, prompts[0], 24, stop_ids=[stop]))
    for want, (tokens, _) in zip(wants, outs):
        assert tokens == want
    cut, verdicts = outs[-1]
    assert cut == wants[0][:wants[0].index(stop) + 1]
    assert verdicts[-1].finish_reason == pb.FINISH_REASON_STOP
    assert server.metrics.value("sled_draft_tokens_total") > 0


async def test_lora_self_drafting_samples_the_target_distribution(serve, models, tokenizer, prompts):
    """Three tokens per request: the second is a verified SAT guess (or its residual resample).
    The slot's embedding is the target's likeliest first token's and the deltas are small, so
    the guess is often right and both the accept and the reject branch are exercised."""
    model = copy.deepcopy(models["llama"])
    p1, p2 = exact_distributions(model, prompts[0], Sampling(1.0, 12))
    likeliest = model.get_input_embeddings()(p1.argmax()[None, None])[0].detach()
    spec = SatSpec(slots=1, embeddings=likeliest, lora=random_lora(model, seed=6, scale=0.05))
    server = await serve(model, sat=spec, max_batch_sessions=64)
    n = 3200
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub, gate = VerifierStub(channel), asyncio.Semaphore(64)

        async def one(seed):
            async with gate:
                tokens, _ = await server_sat(stub, prompts[0], 3, sampling=Sampling(1.0, 12, seed=seed))
                return tokens

        samples = await asyncio.gather(*(one(seed) for seed in range(n)))
    assert 0 < server.metrics.value("sled_accepted_tokens_total") < \
        server.metrics.value("sled_draft_tokens_total")
    for position, p in ((0, p1), (1, p2)):
        support = int((p > 1e-4).sum())
        assert total_variation([s[position] for s in samples], p) < 0.8 * math.sqrt(support / n)
