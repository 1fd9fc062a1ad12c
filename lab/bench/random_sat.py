"""A SAT adapter of random weights for any target's shape: what `sled bench sdsat --sat-adapter
random` serves a target that has no adapter with (a synthetic one on a GPU machine, where no
trained adapter of its shape exists).

Its guesses mean nothing, so the tokens a pass accepts are a random model's; what a pass with its
slots costs is what a trained adapter's pass costs, for it has the same parts as the built-in
adapter: SLOTS slot embeddings and LoRA deltas of rank RANK on every projection. B starts at
zero, as LoRA's does: the deltas add nothing, their GEMMs still run, and every standard token's
output stays the target's own.

    write_random_adapter("synthetic:gemma3-4b", "bench-results/sdsat-random-sat.safetensors")
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sled.models import resolve_model
from verify_server.sat_lora import DEFAULT_MODULES, SatLora
from verify_server.sdsat import save_adapter
from verify_server.synthetic import is_synthetic, synthetic_config

RANDOM = "random"           # the --sat-adapter value that asks for one
SLOTS, RANK, ALPHA = 4, 8, 16.0     # the built-in gemma3-270m adapter's
SEED = 0


def random_adapter_path(out: str | Path) -> Path:
    """Where a benchmark writing `out` keeps its random adapter: beside it."""
    out = Path(out)
    return out.with_name(f"{out.stem}-random-sat.safetensors")


def write_random_adapter(model: str, path: str | Path) -> Path:
    """A seeded random adapter for `model` (an alias, a checkpoint or synthetic:NAME) at `path`:
    slot embeddings and zero-started LoRA deltas, each drawn at the model's initializer scale."""
    config = synthetic_config(model) if is_synthetic(model) else \
        AutoConfig.from_pretrained(resolve_model(model))
    with torch.device("meta"):          # the modules' shapes, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(SEED)
    scale = getattr(config, "initializer_range", 0.02)
    embeddings = torch.randn(SLOTS, config.hidden_size, generator=generator) * scale
    deltas = {}
    for name, module in skeleton.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_MODULES:
            a = torch.randn(RANK, module.in_features, generator=generator) * scale
            deltas[name] = (a, torch.zeros(module.out_features, RANK))
    return save_adapter(path, embeddings, {"base_model": model, "mode": RANDOM, "seed": SEED},
                        SatLora(RANK, ALPHA, deltas))
