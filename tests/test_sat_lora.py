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
from test_sampling_e2e import exact_distributions, total_variation
from test_sdsat_serving import SLOTS, adapter_spec, server_sat

from conftest import greedy_reference
from lab.tiny import make_model
from sled.v1 import verifier_pb2 as pb
from sled.v1.verifier_pb2_grpc import VerifierStub
from sled.wire.sampling import Sampling
from verify_server.engines import make_engine
from verify_server.engines.rows import Row
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


@pytest.mark.parametrize("kind", ["paged", "flex", "padded"])
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


@pytest.mark.parametrize("kind", ["paged", "flex", "padded"])
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


async def test_the_server_says_what_carries_its_sats(serve, models, caplog):
    import logging

    model = copy.deepcopy(models["llama"])
    with caplog.at_level(logging.INFO, logger="sled.server"):
        await serve(model, sat=lora_spec(model))
        await serve(model)
    assert "3 SAT slots, lora)" in caplog.text and "; no SATs)" in caplog.text


async def test_lora_self_drafting_samples_the_target_distribution(serve, models, tokenizer, prompts):
    """Three tokens per request: the second is a verified SAT guess, or the keyed pick that
    replaces it (seeded: keyed sampling).
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


# --- the adapter shipped for the built-in gemma3-270m target -----------------------------------

@pytest.fixture(scope="module")
def gemma3_270m():
    """(float32 model, its shipped SAT LoRA spec, two code prompts in its tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sled.models import builtin_sat_adapter, hf_checkpoint

    path = hf_checkpoint("gemma3-270m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
             "import os\n\nfor name in sorted(os.listdir('.')):\n"]
    return model, load_adapter(builtin_sat_adapter("gemma3-270m")), [tokenizer(t).input_ids for t in texts]


def test_the_shipped_adapter_is_sat_only_lora_and_matches_peft_on_gemma3_270m(gemma3_270m):
    """A real float32 forward of the built-in target: real-token logits equal bit for bit with and
    without the shipped deltas; the SAT slots' equal peft's reference forward."""
    model, spec, prompts = gemma3_270m
    assert spec.kind == "lora" and spec.slots == 4
    plain = SatSpec(slots=spec.slots, embeddings=spec.embeddings)
    with_deltas = engine_logits(copy.deepcopy(model), spec, prompts, "paged", spec.slots)
    without = engine_logits(copy.deepcopy(model), plain, prompts, "paged", spec.slots)
    reference = to_peft(copy.deepcopy(model), spec.lora).eval()
    for prompt, got, want in zip(prompts, with_deltas, without):
        real = len(prompt)
        assert torch.equal(got[:real], want[:real])
        with torch.no_grad():
            with reference.disable_adapter():
                cache = reference(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
            slots = reference(inputs_embeds=spec.embeddings[None], past_key_values=cache, use_cache=True,
                              position_ids=torch.arange(real, real + spec.slots)[None]).logits[0]
        torch.testing.assert_close(got[real:], slots, rtol=1e-3, atol=1e-3)
        assert not torch.allclose(got[real:], want[real:], atol=1e-2)   # the deltas act there


# --- SAT blocks after every cut of a draft (self-drafting's tree) ------------------------------

def prefilled(engine, context: list[int]):
    kv = engine.new_kv()
    kv.admit(context, len(context) + 64, b"")
    engine.forward([Row(kv, context, False)])
    kv.commit(len(context))
    return kv


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_block_after_each_cut_equals_a_chain_cut_there(models, prompts, arch):
    """A row [t g1 g2 g3] with a SAT block after each of its four prefixes gives, per block,
    the SAT outputs of a plain row cut at that prefix; the real tokens' outputs are the chain's.
    A plain session in the same pass is unaffected. The context (30 tokens) passes the tiny
    Gemma's 16-token sliding window, so the window is applied by position."""
    model = copy.deepcopy(models[arch])
    spec = lora_spec(model, seed=7)
    context, draft = (prompts[0] * 4)[:30], [11, 12, 13, 14]
    engine = make_engine(model, kv_budget_bytes=8 << 20, kind="paged", sat=spec)
    tree_kv, other_kv = prefilled(engine, context), prefilled(engine, prompts[1])
    tree, other = engine.forward([Row(tree_kv, draft, True, SLOTS, (1, 2, 3, 4)),
                                  Row(other_kv, [9], True)])
    for anchor in (1, 2, 3, 4):
        chain = make_engine(model, kv_budget_bytes=8 << 20, kind="paged", sat=spec)
        (alone,) = chain.forward([Row(prefilled(chain, context), draft[:anchor], True, SLOTS)])
        block = tree[4 + (anchor - 1) * SLOTS:4 + anchor * SLOTS]
        torch.testing.assert_close(block, alone[anchor:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tree[:anchor], alone[:anchor], rtol=1e-6, atol=1e-6)
    single = make_engine(model, kv_budget_bytes=8 << 20, kind="paged", sat=spec)
    (want,) = single.forward([Row(prefilled(single, prompts[1]), [9], True)])
    torch.testing.assert_close(other, want, rtol=1e-6, atol=1e-6)


def test_the_padded_engine_refuses_branched_blocks(models, prompts):
    model = copy.deepcopy(models["llama"])
    engine = make_engine(model, kv_budget_bytes=8 << 20, kind="padded", sat=lora_spec(model))
    assert not engine.branches and make_engine(model, kv_budget_bytes=1 << 20, kind="paged").branches
    kv = engine.new_kv()
    kv.admit([], 32, b"")
    with pytest.raises(ValueError, match="branched"):
        engine.forward([Row(kv, prompts[0][:3], True, SLOTS, (1, 2, 3))])


async def test_self_drafting_guesses_after_a_cut_draft_too(serve, models, tokenizer, prompts):
    """With blocks after every cut, a pass after a partly accepted draft still verifies guesses:
    no pass but the first has an empty draft (unless the output is about to end)."""
    model = copy.deepcopy(models["llama"])
    server = await serve(model, sat=lora_spec(model, seed=8))
    async with grpc.aio.insecure_channel(server.address) as channel:
        tokens, verdicts = await server_sat(VerifierStub(channel), prompts[3], 30)
    assert tokens == greedy_reference(model, prompts[3], 30)
    assert any(v.accepted < v.verified for v in verdicts)          # some drafts were cut
    emitted = 0
    for verdict in verdicts:                                        # and every next pass had guesses
        assert verdict.verified == (min(SLOTS, 30 - emitted - 1) if emitted else 0)
        emitted += len(verdict.emitted_ids)


def test_the_builtin_target_ships_both_adapter_kinds():
    from sled.models import builtin_sat_adapter

    assert load_adapter(builtin_sat_adapter("gemma3-270m")).kind == "lora"
    assert load_adapter(builtin_sat_adapter("gemma3-270m", "embeddings")).kind == "embeddings"
    assert builtin_sat_adapter("smollm2-135m") is None
    with pytest.raises(ValueError, match="unknown SAT adapter kind 'full'"):
        builtin_sat_adapter("gemma3-270m", "full")
