"""PagedEngine, the CPU default: every row's new tokens packed into one ragged sequence [1, T],
each token with its own position id. A registered attention function writes each layer's new
keys/values straight into the rows' slots and attends over each row's slots, with a dense mask
per group of rows from `visibility` (under sled's forward the layer functions write the KV and
gather and scatter the groups' queries themselves: `decoder.AroundAttention`). Per step the only KV bytes written are the new tokens';
logits are computed only where a row wants them.

    rows:  a (past 3, new 2)   b (past 1, new 3)
    packed input ids:  a a b b b      positions:  3 4 1 2 3
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verify_server.engines import visibility
from verify_server.engines.base import NO_MASK, Engine, StepLogits, logit_spans
from verify_server.engines.blocks import BlockPool
from verify_server.engines.decoder import AroundAttention, gather_queries, scatter_outputs
from verify_server.engines.rows import Row, sat_inputs
from verify_server.sdsat import SatSpec

ATTENTION_NAME = "sled_paged"
SHORT_ROW = 64   # rows up to this many new tokens share one padded attention call


@dataclass(slots=True)
class _Group:
    """Rows attended together: their queries padded to one width and their slots to one length."""
    q_index: torch.Tensor     # [B, W] packed position of each query (padding -> T, a zero query)
    q_valid: torch.Tensor     # [B, W]
    read_slots: tuple[torch.Tensor, ...]  # per layer group [B, L]: pool slots of each row's
                                          # context (padding, a dropped block -> the zero block)
    query_pos: torch.Tensor   # [B, W] position id of each query
    starts: torch.Tensor      # [B] committed length: where the row's new entries begin
    widths: torch.Tensor      # [B] new entries
    seen: torch.Tensor        # [B, W, W] which new entries each new entry sees
    masks: dict = field(default_factory=dict)   # sliding window (or None) -> [B, 1, W, L]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = self._mask(window)
        return self.masks[window]

    def _mask(self, window: int | None) -> torch.Tensor:
        """visibility.attends at every (query, key) of the group: keys by their place in the
        row, new entries by their position id."""
        rows, width = self.q_index.shape
        keys = torch.arange(self.read_slots[0].shape[1], device=self.q_index.device)
        new = keys[None, None, :] - self.starts[:, None, None]               # [B, 1, L]
        entry = new.clamp(0, width - 1)
        seen = torch.gather(self.seen, 2, entry.expand(rows, width, -1))     # [B, W, L]
        entry_pos = torch.gather(self.query_pos, 1, entry[:, 0])[:, None]    # [B, 1, L]
        allowed = visibility.attends(new, self.widths[:, None, None], seen, keys, entry_pos,
                                     self.query_pos[:, :, None], window)
        allowed = allowed & self.q_valid[:, :, None]
        allowed[..., 0] |= ~self.q_valid  # padding queries look at the zero slot: no NaN
        return allowed[:, None]


@dataclass(slots=True)
class _Step(AroundAttention):
    """sled's forward writes the KV, gathers the queries and scatters the outputs inside its
    layer functions (`AroundAttention`); `attend` reads each group's slots out of the pool."""
    pool: BlockPool
    write_slots: tuple[torch.Tensor, ...]   # per layer group [T]
    groups: list[_Group]
    tokens: int
    q_index: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        self.q_index = tuple(group.q_index for group in self.groups)

    def attend(self, layer: int, queries, window: int | None, scaling: float | None,
               softcap: float | None = None) -> list[torch.Tensor]:
        """Each group's queries [B, H, W, D] over its rows' slots, gathered, with its mask."""
        outputs, kv_group = [], self.pool.group_of[layer]
        for group, q in zip(self.groups, queries):
            k, v = self.pool.read(layer, group.read_slots[kv_group])      # [B, L, KVH, D]
            k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
            mask = group.mask(window)
            if softcap is None:
                outputs.append(torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]))
            else:
                outputs.append(_softcapped_attention(q, k, v, mask, scaling, softcap))
        return outputs


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, sled_step: _Step | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] of the packed new tokens -> ([1, T, H, D], None).

    Outside an engine step (e.g. `generate()` on the same model object) this is plain SDPA.
    """
    if sled_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                      **kwargs)
    step, layer = sled_step, module.layer_idx
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)   # [T, KVH, D]
    step.pool.write(layer, step.slots_of(layer), new_k, new_v)
    queries = gather_queries(query[0].transpose(0, 1), step.q_index)
    outputs = step.attend(layer, queries, sliding_window, scaling, softcap)
    return scatter_outputs(outputs, step.q_index, step.tokens)[None], None


def _softcapped_attention(q, k, v, mask, scaling, softcap):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


AttentionInterface.register(ATTENTION_NAME, paged_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)   # for use outside an engine step


class PagedEngine(Engine):
    kind = "paged"
    branches = True
    own_forward = True

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None,
                 forward: str = "sled") -> None:
        super().__init__(model, pool, sat, forward)
        self.activate()

    def activate(self) -> None:
        self.model.set_attn_implementation(ATTENTION_NAME)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return bool(getattr(model, "_supports_attention_backend", False))

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> StepLogits:
        self._fresh_decoder()
        step, input_ids, position_ids, sat_at = self._plan(rows)
        index, spans = logit_spans(rows)
        with self._sat_deltas([i for i, _ in sat_at]):
            logits = self._logits(
                bool(sat_at), **self._inputs(input_ids[None], [((0, i), slot) for i, slot in sat_at]),
                position_ids=position_ids[None].to(self.device),
                attention_mask=NO_MASK.to(self.device), use_cache=False,
                logits_to_keep=torch.tensor(index, device=self.device), sled_step=step)
        self.bytes_copied += step.tokens * self.pool.shape.bytes_per_token
        return StepLogits(logits[0], spans)

    def _plan(self, rows: Sequence[Row]):
        ids, offsets = [], []
        kv_groups = range(len(self.pool.groups))
        writes = [[] for _ in kv_groups]
        offset = 0
        for row in rows:
            start, n = row.kv.length, row.width
            ids.extend(row.tokens)
            ids.extend([0] * (n - len(row.tokens)))  # placeholders: their embeddings are the SATs'
            for g in kv_groups:
                writes[g].append(row.kv.slots(start, start + n, g))
            offsets.append(offset)
            offset += n
        short = [b for b, row in enumerate(rows) if row.width <= SHORT_ROW]
        long = [[b] for b, row in enumerate(rows) if row.width > SHORT_ROW]
        positions = torch.zeros(offset, dtype=torch.long)
        groups = [self._group([rows[b] for b in members], [offsets[b] for b in members], positions,
                              offset)
                  for members in ([short] if short else []) + long]
        step = _Step(self.pool, tuple(torch.cat(w).to(self.device) for w in writes), groups,
                     offset)
        return step, torch.tensor(ids, dtype=torch.long), positions, sat_inputs(rows)

    def _group(self, rows: Sequence[Row], offsets: Sequence[int],
               positions: torch.Tensor, tokens: int) -> _Group:
        """The group's tensors, and its rows' position ids written into the packed `positions`
        (of the step's `tokens`)."""
        starts = np.array([row.kv.length for row in rows], dtype=np.int64)
        widths = np.array([row.width for row in rows], dtype=np.int64)
        width, length = int(widths.max()), int((starts + widths).max())
        query_pos, seen = visibility.plan(rows, starts, widths, width)
        q_index = torch.full((len(rows), width), tokens, dtype=torch.long)
        q_valid = torch.zeros(len(rows), width, dtype=torch.bool)
        kv_groups = range(len(self.pool.groups))
        # slot 0: the zero block
        read_slots = [torch.zeros(len(rows), length, dtype=torch.long) for _ in kv_groups]
        for b, (row, offset, start, n) in enumerate(zip(rows, offsets, starts, widths)):
            q_index[b, :n] = torch.arange(offset, offset + n)
            q_valid[b, :n] = True
            positions[offset:offset + n] = torch.from_numpy(query_pos[b, :n])
            for g in kv_groups:
                read_slots[g][b, :start + n] = row.kv.slots(0, start + n, g)
        dev = self.device
        return _Group(q_index.to(dev), q_valid.to(dev), tuple(r.to(dev) for r in read_slots),
                      torch.from_numpy(query_pos).to(dev), torch.from_numpy(starts).to(dev),
                      torch.from_numpy(widths).to(dev), torch.from_numpy(seen).to(dev))
