"""Targets without weights: a Gemma 3 shape with random weights made in-process.

`sled serve --model synthetic:gemma3-4b` serves a model with the layers, widths, heads and
vocabulary of Gemma 3 4B (text) and random weights drawn in the chosen dtype on the chosen device:
every step costs the compute and memory real weights would, so throughput, capacity and memory
figures hold for the real model, with nothing to download. Its outputs are random text, so
benchmarks replay a synthetic acceptance process for its devices (lab.traces.synthetic) and
check every output against the server's own.

The tokenizer is Gemma 3's, from the built-in gemma3-270m (Gemma 3 270M to 27B share it), so a
device can still turn text into the target's ids. Shapes follow the public configs of the Gemma 3
text models (hidden size, MLP width, layers, attention and KV heads, head size, sliding window;
five sliding-window layers to one global one); the rope settings are the 270M's, which changes
values, not cost. The weights are seeded, so one name gives one model.
"""
from __future__ import annotations

import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from sled.models import hf_checkpoint
from verify_server.shapes import layer_types

PREFIX = "synthetic:"
SEED = 0

# name -> Gemma3TextConfig fields that differ from the 270M's
SHAPES: dict[str, dict] = {
    "gemma3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=1024),
    "gemma3-12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       query_pre_attn_scalar=256, sliding_window=1024),
    "gemma3-27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                       query_pre_attn_scalar=168, sliding_window=1024),
}


def is_synthetic(model_id: str) -> bool:
    return model_id.startswith(PREFIX)


def shape_of(model_id: str) -> dict:
    """The config fields of synthetic:NAME; ValueError naming the shapes for an unknown one."""
    name = model_id.removeprefix(PREFIX)
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic target {model_id!r}: use synthetic:NAME with NAME "
                         f"one of {', '.join(SHAPES)}")
    return SHAPES[name]


def synthetic_config(model_id: str):
    """The Gemma3TextConfig of synthetic:NAME: the 270M's config with NAME's shape."""
    shape = shape_of(model_id)
    config = Gemma3TextConfig.from_pretrained(hf_checkpoint("gemma3-270m"))
    for key, value in shape.items():
        setattr(config, key, value)
    config.layer_types = layer_types(shape["num_hidden_layers"])
    config.name_or_path = model_id
    return config


def synthetic_model(model_id: str, dtype: torch.dtype, device: str = "cpu"):
    """(model, tokenizer): random weights of synthetic:NAME's shape, made directly in `dtype` on
    `device` (no float32 copy first), seeded; Gemma 3's tokenizer."""
    config = synthetic_config(model_id)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Gemma3ForCausalLM._from_config(config, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(hf_checkpoint("gemma3-270m"))
