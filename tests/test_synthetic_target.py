"""Targets without weights (synthetic:NAME): the Gemma 3 shapes are the real models' sizes, an
unknown name is refused naming the shapes, and a synthetic target is served like any other: its
greedy output over gRPC is its own generate()'s."""
from __future__ import annotations

import pytest
import torch

from conftest import run_sled
from verify_server.synthetic import SHAPES, layer_types, shape_of, synthetic_config


@pytest.mark.parametrize("name,billions", [("gemma3-270m", 0.268), ("gemma3-1b", 1.00),
                                           ("gemma3-4b", 3.88), ("gemma3-12b", 11.77),
                                           ("gemma3-27b", 27.0)])
def test_each_shape_has_its_models_parameter_count(name, billions):
    """Counted on the meta device (nothing allocated): the text model's published size, within 3%
    (the 4B and larger published sizes also count a vision tower, which a text target has not)."""
    from transformers import Gemma3ForCausalLM

    with torch.device("meta"):
        model = Gemma3ForCausalLM(synthetic_config(f"synthetic:{name}"))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.03)


def test_five_sliding_window_layers_to_one_global():
    assert layer_types(12) == (["sliding_attention"] * 5 + ["full_attention"]) * 2


def test_an_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown synthetic target 'synthetic:gemma3-2b'") as refused:
        shape_of("synthetic:gemma3-2b")
    assert all(name in str(refused.value) for name in SHAPES)


def test_sled_serve_refuses_an_unknown_shape_in_one_line():
    done = run_sled("serve", "--model", "synthetic:gemma3-2b", "--port", "0", timeout=120)
    assert done.returncode != 0 and "unknown synthetic target" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
async def test_a_synthetic_target_serves_its_own_greedy_output():
    from edge_client.session import RoundSettings, generate
    from drafters.ngram import NgramDrafter
    from edge_client.wire import SessionRequest
    from tests.test_lossless import server_stub
    from verify_server.server import start_server
    from verify_server.target import Target

    target = Target.load("synthetic:gemma3-270m", dtype="float32")
    assert (target.model_id, target.vocab_size) == ("synthetic:gemma3-270m", 262144)
    prompt = target.tokenizer("def fibonacci(n):").input_ids
    with torch.inference_mode():
        reference = target.model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                          do_sample=False)[0, len(prompt):].tolist()
    server = await start_server(target)
    try:
        result = await generate(server_stub(server), NgramDrafter(),
                                SessionRequest(prompt, max_new_tokens=12, ignore_eos=True),
                                settings=RoundSettings(draft_len=3))
    finally:
        await server.stop(grace=0)
    assert result.token_ids == reference
