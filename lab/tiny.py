"""Tiny random models with a real (small, trained) tokenizer: for tests, the loopback demo and the
overhead benchmark. They need no download; their output is meaningless but fully deterministic."""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from sled.cache import cache_dir, partial_dir

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "The server verifies every device's draft in one batched forward pass.\n",
    "Small devices draft tokens; the shared target model accepts or corrects them.\n",
    "class Session:\n    def __init__(self, prompt):\n        self.prompt = prompt\n",
    "import math\nprint(math.sqrt(16))\n",
] * 4
SPECIALS = ["<pad>", "<s>", "</s>"]


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on CORPUS (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def make_model(arch: str, vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64,
               dtype: torch.dtype = torch.float32, sliding_window: int = 16):
    """A tiny randomly initialised causal LM: arch is "llama" or "gemma3"."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=hidden // 4,
                                                   sliding_window=sliding_window,
                                                   sliding_window_pattern=2))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}: llama or gemma3")
    # Random init gives near-uniform logits; widen them so greedy choices are clear-cut.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval()


def perturbed(model, scale: float, seed: int = 1):
    """A copy of `model` with relative noise on every weight: a drafter that agrees often, not always."""
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype)
            param.add_(noise * param.abs().mean() * scale)
    return clone


def save_pair(folder: Path, arch: str = "llama", dtype: torch.dtype = torch.float32,
              drafter_noise: float = 0.1) -> tuple[Path, Path]:
    """Write a tiny target and a perturbed drafter (with tokenizer) under folder; returns both paths."""
    folder = Path(folder)
    target_dir, drafter_dir = folder / f"{arch}-target", folder / f"{arch}-drafter"
    if (target_dir / "config.json").exists() and (drafter_dir / "config.json").exists():
        return target_dir, drafter_dir
    tokenizer = make_tokenizer()
    target = make_model(arch, len(tokenizer), dtype=dtype)
    for path, model in ((target_dir, target), (drafter_dir, perturbed(target, drafter_noise))):
        _save_whole(path, model, tokenizer)
    return target_dir, drafter_dir


def _save_whole(path: Path, model, tokenizer) -> None:
    """Model and tokenizer written beside PATH, then renamed into place: another process (a
    parallel test worker, a second bench) never sees a config.json without its weights."""
    if (path / "config.json").exists():
        return
    partial = partial_dir(path)
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(path)
        except OSError:            # there already: another process's whole copy stays
            if (path / "config.json").exists():
                return
            shutil.rmtree(path, ignore_errors=True)   # a folder without a config: replaced
            partial.rename(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def cached_pair() -> tuple[str, str]:
    """The tiny target and drafter in sled's cache (written on first use): benchmarks' default."""
    target, drafter = save_pair(cache_dir() / "tiny")
    return str(target), str(drafter)
