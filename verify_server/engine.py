"""The batched forward: every scheduled session's new tokens through the target in one pass.

Each session keeps its own KV between rounds. A step left-pads the sessions' KV to a common past
length and right-pads their new tokens to a common width, runs the model once, and hands each
session back its KV extended by its new tokens. Padding is masked out and position ids are each
session's own, so every row computes exactly what it would alone.

    session a: past [a a a]   new [x x]        padded past  . a a a | x x .
    session b: past [b]       new [y y y]      (B=2, L=3)   . . . b | y y y
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from verify_server.kv import SessionKV


@dataclass(slots=True)
class Row:
    kv: SessionKV
    tokens: Sequence[int]     # new tokens, appended after kv
    want_logits: bool         # False for prefill: only the KV is needed


class Engine:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """One pass over all rows; returns logits [len(tokens), vocab] for rows that want them."""
        batch = len(rows)
        past = [row.kv.length for row in rows]
        widths = [len(row.tokens) for row in rows]
        max_past, max_new = max(past), max(widths)

        input_ids = torch.zeros(batch, max_new, dtype=torch.long)
        position_ids = torch.zeros(batch, max_new, dtype=torch.long)
        attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long)
        for b, (row, length, width) in enumerate(zip(rows, past, widths)):
            input_ids[b, :width] = torch.as_tensor(row.tokens, dtype=torch.long)
            position_ids[b] = torch.arange(length, length + max_new)
            attention_mask[b, max_past - length:max_past + width] = 1

        want = any(row.want_logits for row in rows)
        out = self.model(
            input_ids=input_ids.to(self.device),
            position_ids=position_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            past_key_values=self._padded_cache(rows, max_past),
            use_cache=True,
            logits_to_keep=0 if want else 1,
        )
        cache = out.past_key_values
        logits: list[torch.Tensor | None] = []
        for b, (row, length, width) in enumerate(zip(rows, past, widths)):
            span = slice(max_past - length, max_past + width)
            row.kv.layers = [
                (layer.keys[b:b + 1, :, span].clone(), layer.values[b:b + 1, :, span].clone())
                for layer in cache.layers[: self.num_layers]
            ]
            logits.append(out.logits[b, :width].float() if row.want_logits else None)
        return logits

    def _padded_cache(self, rows: Sequence[Row], max_past: int) -> DynamicCache:
        """The rows' KV, left-padded to max_past, as one transformers cache."""
        if max_past == 0:
            return DynamicCache()
        template = next(row.kv for row in rows if row.kv.length)
        layers = []
        for layer in range(self.num_layers):
            k0, v0 = template.layers[layer]
            keys = k0.new_zeros((len(rows), k0.shape[1], max_past, k0.shape[3]))
            values = v0.new_zeros((len(rows), v0.shape[1], max_past, v0.shape[3]))
            for b, row in enumerate(rows):
                if row.kv.length:
                    k, v = row.kv.layers[layer]
                    keys[b, :, max_past - row.kv.length:] = k[0]
                    values[b, :, max_past - row.kv.length:] = v[0]
            layers.append((keys, values))
        return DynamicCache(layers)
