"""A transformers causal LM as drafter (any AutoModelForCausalLM that shares the target's ids)."""
from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from drafters.base import KVDrafter
from drafters.capabilities import Capabilities
from sled.wire.fingerprint import fingerprint_tokenizer


class HFDrafter(KVDrafter):
    """Runs a transformers model; its DynamicCache holds the KV of the tokens seen."""

    capabilities = KVDrafter.capabilities | Capabilities(checks_guesses=True)

    def __init__(self, model: torch.nn.Module, tokenizer=None, name: str = "hf",
                 q_support: int = 32) -> None:
        super().__init__()
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.name = name
        self.q_support = q_support
        self.tokenizer_fingerprint = fingerprint_tokenizer(tokenizer) if tokenizer is not None else None
        self._cache = DynamicCache()   # full layers: rolling back is a slice

    @classmethod
    def load(cls, path: str, dtype: torch.dtype = torch.float32, q_support: int = 32) -> "HFDrafter":
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
        return cls(model, tokenizer, name=f"hf:{path}", q_support=q_support)

    def _truncate(self, length: int) -> int:
        for layer in self._cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]
        return length

    def _run(self, tokens: list[int]) -> np.ndarray:  # [vocab] float32, for choose_token
        return self._run_tail(tokens, 1)[-1]

    @torch.inference_mode()
    def _run_tail(self, tokens: list[int], rows: int) -> np.ndarray:  # [rows, vocab] float32
        start = len(self._seen)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=rows)
        return out.logits[0].float().cpu().numpy()
