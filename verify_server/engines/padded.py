"""PaddedEngine, the generic fallback, for architectures that do not route attention through
transformers' attention interface: it gathers the rows' KV into a left-padded transformers
cache, runs the model, and writes the new tokens back into the pool. Correct for any decoder,
but it copies every row's context each step, and it takes chains only (transformers' own
causal mask is its visibility).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from verify_server.engines.base import Engine, StepLogits
from verify_server.engines.rows import Row


class PaddedEngine(Engine):
    kind = "padded"

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> StepLogits:
        if any(row.branched for row in rows):
            raise ValueError("the padded engine cannot verify tree drafts or branched SAT blocks; "
                             "use the paged engine")
        batch = len(rows)
        past = [row.kv.length for row in rows]
        widths = [row.width for row in rows]
        max_past, max_new = max(past), max(widths)

        input_ids = torch.zeros(batch, max_new, dtype=torch.long)
        position_ids = torch.zeros(batch, max_new, dtype=torch.long)
        attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long)
        sat_at = []
        for b, (length, width) in enumerate(zip(past, widths)):
            n = len(rows[b].tokens)
            input_ids[b, :n] = torch.as_tensor(rows[b].tokens, dtype=torch.long)
            sat_at.extend(((b, n + j), j) for j in range(rows[b].sat_slots))
            position_ids[b] = torch.arange(length, length + max_new)
            attention_mask[b, max_past - length:max_past + width] = 1

        want = any(row.want_logits for row in rows)
        with self._sat_deltas([b * max_new + i for (b, i), _ in sat_at]):
            out = self.model(
                **self._inputs(input_ids, sat_at),
                position_ids=position_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                past_key_values=self._padded_cache(rows, max_past),
                use_cache=True,
                logits_to_keep=0 if want else 1,
            )
        cache = out.past_key_values
        spans, kept, offset = [], [], 0
        for b, (row, width) in enumerate(zip(rows, widths)):
            start = row.kv.length
            slots = row.kv.slots(start, start + width).to(self.device)
            for layer, cached in enumerate(cache.layers[: self.pool.shape.layers]):
                new = slice(max_past, max_past + width)
                self.pool.write(layer, slots, cached.keys[b, :, new].transpose(0, 1),
                                cached.values[b, :, new].transpose(0, 1))
            self.bytes_copied += width * self.pool.shape.bytes_per_token
            spans.append(slice(offset, offset + width) if row.want_logits else None)
            if row.want_logits:
                kept.append(out.logits[b, :width])
                offset += width
        packed = torch.cat(kept) if kept else out.logits[0, :0]
        return StepLogits(packed, spans)

    def _padded_cache(self, rows: Sequence[Row], max_past: int) -> DynamicCache:
        """The rows' KV, left-padded to max_past, as one transformers cache (a copy)."""
        if max_past == 0:
            return DynamicCache()
        layers = []
        for layer in range(self.pool.shape.layers):
            keys = self.pool.keys[layer].new_zeros(
                (len(rows), self.pool.shape.local_kv_heads, max_past, self.pool.shape.head_dim))
            values = torch.zeros_like(keys)
            for b, row in enumerate(rows):
                if row.kv.length:
                    k, v = self.pool.read(layer, row.kv.slots(0, row.kv.length).to(self.device))
                    keys[b, :, max_past - row.kv.length:] = k.transpose(0, 1)
                    values[b, :, max_past - row.kv.length:] = v.transpose(0, 1)
                    self.bytes_copied += k.nbytes + v.nbytes
            layers.append((keys, values))
        return DynamicCache(layers)

