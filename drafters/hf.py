"""A transformers causal LM as drafter (any AutoModelForCausalLM that shares the target's ids)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from drafters.base import Proposal, SparseQ, choose_token, common_prefix
from sled.fingerprint import fingerprint_tokenizer
from sled.sampling import Sampling


class HFDrafter:
    """Keeps a KV cache of the tokens it has seen; each proposal feeds only what is new."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, name: str = "hf",
                 q_support: int = 32) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.name = name
        self.q_support = q_support
        self.tokenizer_fingerprint = fingerprint_tokenizer(tokenizer) if tokenizer is not None else None
        self._cache = DynamicCache()   # full layers: rolling back is a slice
        self._seen: list[int] = []     # tokens whose keys/values are in the cache

    @classmethod
    def load(cls, path: str, dtype: torch.dtype = torch.float32, q_support: int = 32) -> "HFDrafter":
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
        return cls(model, tokenizer, name=f"hf:{path}", q_support=q_support)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, sampling: Sampling,
                generator: torch.Generator | None = None) -> Proposal:
        # Reuse the cached prefix; at least the last context token is fed to get fresh logits.
        keep = min(common_prefix(self._seen, context), len(context) - 1)
        self.rollback(keep)
        logits = self._feed(list(context[keep:]))
        draft: list[int] = []
        qs: list[SparseQ] = []
        for j in range(k):
            token, q = choose_token(logits, sampling, self.q_support, generator)
            draft.append(token)
            if q is not None:
                qs.append(q)
            if j + 1 < k:
                logits = self._feed([token])
        return Proposal(draft, qs if qs else None)

    def rollback(self, length: int) -> None:
        if length < len(self._seen):
            for layer in self._cache.layers:
                if layer.is_initialized:
                    layer.keys = layer.keys[:, :, :length]
                    layer.values = layer.values[:, :, :length]
            self._seen = self._seen[:length]

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run new tokens through the model; returns the logits after the last one: [vocab]."""
        start = len(self._seen)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._seen.extend(tokens)
        return out.logits[0, -1].float()
