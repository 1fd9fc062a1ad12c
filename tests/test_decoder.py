"""sled's own decoder forward (fused QKV and gate-up, its own norms and rotary) against
transformers' forward, in every engine that runs it: fp32 logits within 1e-5 and the same
argmax, for chains, prefill chunks, trees, decode rows, shared prefix blocks, SAT rows, Gemma 3's
sliding window, the final softcap; and mutations of it (a dropped rotary, gate and up fused in
the wrong order, Llama's norm in Gemma 3) that those comparisons catch."""
from __future__ import annotations

import copy

import pytest
import torch

from lab.tiny import make_model
from test_flex_engine import assert_logits_agree, fragmented_sessions, step_rows
from verify_server.engines import PagedEngine, decoder
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.flex import FlexEngine
from verify_server.engines.rows import Row
from verify_server.sdsat import SatSpec

ENGINES = {"paged": PagedEngine, "flex": FlexEngine}
VOCAB = 320


def tiny(arch: str, **config) -> torch.nn.Module:
    model = make_model(arch, VOCAB, dtype=torch.float32)
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


def both_forwards(model, kind: str, sat: SatSpec | None = None):
    """Two engines of one kind over two pools of the same size: sled's forward and
    transformers', each on its own copy of the model."""
    engines = []
    for forward in ("sled", "transformers"):
        pool = BlockPool(KVShape.of(model), 96, 8)
        engines.append(ENGINES[kind](copy.deepcopy(model), pool, sat=sat, forward=forward))
    return engines


def step_logits(engine, prompt):
    kvs = fragmented_sessions(engine, [21, 9, 30, 14], prompt)
    return list(engine.forward(step_rows(kvs)))


MODELS = {
    "llama": lambda: tiny("llama"),
    "gemma3 (window 16)": lambda: tiny("gemma3"),
    # Gemma 3 caps its final logits where configured (transformers' Gemma 3 passes no softcap
    # to attention: the engines' softcapped attention serves Gemma 2 through transformers)
    "gemma3 final softcap": lambda: tiny("gemma3", final_logit_softcapping=15.0),
}


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("name", MODELS)
def test_sled_forward_gives_transformers_logits_in_every_engine(name, kind):
    model = MODELS[name]()
    mine, theirs = both_forwards(model, kind)
    assert mine.decoder is not None and theirs.decoder is None
    prompt = list(range(40, 61))
    assert_logits_agree(step_logits(mine, prompt), step_logits(theirs, prompt))


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sat_rows_through_sled_forward_match_transformers(arch, kind):
    """SAT slots are embeddings written into the input: sled's forward takes them as inputs_embeds."""
    model = tiny(arch)
    sat = SatSpec(slots=3, token_ids=[7, 8, 9])
    mine, theirs = both_forwards(model, kind, sat=sat)
    outputs = []
    for engine in (mine, theirs):
        kvs = fragmented_sessions(engine, [21, 9, 30, 14], list(range(40, 61)))
        rows = [Row(kvs[0], [1, 2, 3], True, sat_slots=2, sat_anchors=(1, 2, 3)),
                Row(kvs[1], [4, 5], True, sat_slots=3),
                Row(kvs[2], [6], True)]
        outputs.append(list(engine.forward(rows)))
    assert_logits_agree(*outputs)


def test_fused_weights_are_transformers_weights_not_copies():
    model = tiny("llama")
    before = _parameter_bytes(model)
    engine = PagedEngine(model, BlockPool(KVShape.of(model), 16, 8))
    layer, attn = engine.decoder.layers[0], model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == layer.qkv_w.data_ptr()
    assert attn.k_proj.weight.data_ptr() == layer.qkv_w[attn.q_proj.weight.shape[0]:].data_ptr()
    assert _parameter_bytes(model) == before        # storage shared, nothing held twice
    # transformers' own forward still reads the fused numbers: generate() is unchanged
    assert decoder.decoder_for(model) is engine.decoder


def test_a_model_cast_after_the_engine_is_fused_again():
    model = tiny("llama").double()
    engine = PagedEngine(model, BlockPool(KVShape.of(model), 96, 8))
    reference = PagedEngine(copy.deepcopy(model).float(), BlockPool(KVShape.of(model.float()), 96, 8),
                            forward="transformers")
    model.float()                                   # replaces every parameter
    engine.pool = BlockPool(KVShape.of(model), 96, 8)
    assert not engine.decoder.fresh()
    prompt = list(range(40, 61))
    assert_logits_agree(step_logits(engine, prompt), step_logits(reference, prompt))
    assert engine.decoder.fresh()


def _drop_rotary(monkeypatch, engine):
    monkeypatch.setattr(decoder, "rotate", lambda x, cos, sin: x)


def _swap_gate_and_up(monkeypatch, engine):
    for layer in engine.decoder.layers:
        gate, up = layer.gate_up_w.chunk(2)
        layer.gate_up_w = torch.cat([up, gate])


def _llama_norm_in_gemma(monkeypatch, engine):
    monkeypatch.setattr(decoder, "gemma_norm", decoder.llama_norm)


@pytest.mark.parametrize("mutate,arch", [(_drop_rotary, "llama"), (_swap_gate_and_up, "llama"),
                                         (_llama_norm_in_gemma, "gemma3")])
def test_the_comparison_catches_a_broken_forward(monkeypatch, mutate, arch):
    mine, theirs = both_forwards(tiny(arch), "paged")
    mutate(monkeypatch, mine)
    prompt = list(range(40, 61))
    with pytest.raises(AssertionError):
        assert_logits_agree(step_logits(mine, prompt), step_logits(theirs, prompt))


def test_other_architectures_keep_transformers_forward():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert not decoder.supports(model)
    assert decoder.supports(tiny("llama")) and decoder.supports(tiny("gemma3"))


def test_an_unknown_forward_is_refused():
    model = tiny("llama")
    with pytest.raises(ValueError, match="unknown forward 'fast': use sled or transformers"):
        PagedEngine(model, BlockPool(KVShape.of(model), 16, 8), forward="fast")


def _parameter_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_layer_functions_match_and_compile_once_for_every_token_count(arch):
    """What an engine on CUDA runs, compiled here by inductor's CPU backend: one compile of each
    layer function serves every layer and every token count past one."""
    from torch._dynamo.utils import counters
    model = tiny(arch)
    mine, theirs = both_forwards(model, "paged")
    mine.compile_layers = True
    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    graphs = []
    outputs = {id(mine): [], id(theirs): []}
    for engine in (mine, theirs):
        kv = engine.new_kv()
        kv.admit([], 120, b"")
        for tokens in ([5] * 37, [6, 7, 8, 9, 10], [11, 12], [13] * 19):
            outputs[id(engine)].append(engine.forward([Row(kv, tokens, True)])[0])
            kv.commit(len(tokens))
            if engine is mine:
                graphs.append(counters["stats"]["unique_graphs"] - start)
    assert_logits_agree(outputs[id(mine)], outputs[id(theirs)])
    assert graphs[0] == 2 and graphs[-1] == 2, graphs     # before and after attention, once


def test_biased_projections_are_fused_with_their_biases():
    """A Llama with attention and MLP biases (as some checkpoints of the family have)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        attention_bias=True, mlp_bias=True)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)              # zero biases would hide a wrong fusion
    mine, theirs = both_forwards(model, "paged")
    layer, attn = mine.decoder.layers[0], mine.model.model.layers[0].self_attn
    assert layer.qkv_b is not None and attn.k_proj.bias.data_ptr() == layer.qkv_b[
        attn.q_proj.weight.shape[0]:].data_ptr()
    prompt = list(range(40, 61))
    assert_logits_agree(step_logits(mine, prompt), step_logits(theirs, prompt))
