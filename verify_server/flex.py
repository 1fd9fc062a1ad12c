"""FlexEngine: attention reads the block pool in place through FlexAttention, in static shapes.

The paged engine (`verify_server.engine.PagedEngine`) gathers every row's whole context out of
the pool for every layer and builds a dense mask each step; its step's shapes change with every
step, and boolean indexing makes the host wait for the device twice a layer. The flex engine
swaps only the attention function (registered through transformers' AttentionInterface, like
the paged one) and keeps the pool, the sessions' KV and the rounds as they are:

- each layer writes the new tokens' keys/values into their slots (`index_copy_`; padding goes to
  the trash slot, the zero block's first) and calls `flex_attention` with the pool itself as K/V
  ([1, kv_heads, slots, head_dim], a view). A BlockMask built from the rows' block tables lists
  the blocks each row reads, and a mask_mod that is complete by itself (eager flex reads no block
  list) decides each (query, key): the key's block must be at that place of the row's table, then
  the context is visible, the new entries by the row's own visibility (chains, trees, SAT
  blocks), and the sliding window by position. Softcap is a score_mod;
- the step's shapes come from a bucket (`verify_server.flex_plan`): rows, width and tokens are
  padded, so every step of a bucket has the same shapes, the buffers are allocated once per
  bucket, and one host-to-device copy of one flat int32 buffer carries a whole step's plan;
- nothing in the forward reads a device value on the host: no boolean indexing, no `.item()`.

On CPU the engine runs eager flex (dense over the pool: a test oracle on small pools, not a fast
path; `PagedEngine` stays the CPU default). On CUDA the flex kernels skip every block a row does
not list.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verify_server.blocks import BlockPool
from verify_server.engine import NO_MASK, Engine, Row, sat_inputs
from verify_server.flex_plan import StepLayout, StepShape, next_pow2, plan_step, step_shape
from verify_server.sdsat import SatSpec

ATTENTION_NAME = "sled_flex"
TRASH_SLOT = 0     # padding tokens' KV goes to the zero block's first slot, which flex never reads


class FlexStep:
    """A bucket's buffers: a pinned host buffer the planner fills, its device twin (one copy per
    step), and each field as a view of the device buffer."""

    def __init__(self, pool: BlockPool, shape: StepShape, kv_width: int, device: torch.device,
                 flex=flex_attention) -> None:
        self.pool, self.shape, self.flex = pool, shape, flex
        self.layout = StepLayout(shape, kv_width, pool.num_blocks)
        pinned = device.type == "cuda"
        self.host_buffer = torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=pinned)
        self.host = self.layout.views(self.host_buffer.numpy())
        self.device_buffer = (torch.zeros_like(self.host_buffer, device=device) if pinned
                              else self.host_buffer)
        self.fields = self.layout.views(self.device_buffer)
        self.tokens = shape.tokens
        self.write_slots = self.fields["write_slots"]
        self.groups = [FlexGroup(self, g, group.width) for g, group in enumerate(shape.groups)]

    def upload(self) -> None:
        if self.device_buffer is not self.host_buffer:
            self.device_buffer.copy_(self.host_buffer, non_blocking=True)


class FlexGroup:
    """One group's views, and its BlockMask per sliding window (built once per bucket: the
    mask_mod reads the buffers, which each step rewrites in place)."""

    def __init__(self, step: FlexStep, g: int, width: int) -> None:
        f = step.fields
        self.step, self.width = step, width
        self.q_index = f[f"q_index{g}"]
        self.table, self.blocks = f[f"table{g}"], f[f"blocks{g}"]
        self.starts, self.widths = f[f"starts{g}"], f[f"widths{g}"]
        self.qpos, self.seen = f[f"qpos{g}"], f[f"seen{g}"]
        self.block_pos = f["block_pos"]
        self.masks: dict[int | None, BlockMask] = {}

    def block_mask(self, window: int | None, heads_per_kv: int) -> BlockMask:
        if window not in self.masks:
            pool = self.step.pool
            rows = self.table.shape[0]
            # copies of the table (its -1 padding clamped: entries past `blocks` are never read)
            # and of the block counts: a mask_mod must not capture the BlockMask's own tensors
            indices = self.table.clamp(min=0).view(rows, 1, 1, -1)
            q_block = max(128, next_pow2(self.width * heads_per_kv))
            self.masks[window] = BlockMask.from_kv_blocks(
                self.blocks.clone().view(rows, 1, 1), indices,
                BLOCK_SIZE=(q_block, pool.block_tokens),
                mask_mod=self.mask_mod(window),
                seq_lengths=(self.width, pool.num_blocks * pool.block_tokens),
                compute_q_blocks=False)
        return self.masks[window]

    def refresh(self) -> None:
        """After a new plan: the BlockMasks hold copies of the table and the block counts."""
        rows = self.table.shape[0]
        for mask in self.masks.values():
            mask.kv_indices.copy_(self.table.clamp(min=0).view(rows, 1, 1, -1))
            mask.kv_num_blocks.copy_(self.blocks.view(rows, 1, 1))

    def mask_mod(self, window: int | None):
        table, block_pos, blocks = self.table, self.block_pos, self.blocks
        starts, widths, qpos, seen = self.starts, self.widths, self.qpos, self.seen
        bt, width, last = self.step.pool.block_tokens, self.width, self.table.shape[1] - 1

        def visible(b, h, q_idx, kv_idx):
            physical = kv_idx // bt
            logical = block_pos[physical]
            place = logical.clamp(0, last)
            member = (logical >= 0) & (logical < blocks[b]) & (table[b, place] == physical)
            position = place * bt + kv_idx % bt              # the key's place in row b
            new = position - starts[b]
            entry = new.clamp(0, width - 1)
            in_context = new < 0
            ok = member & (q_idx < widths[b]) & (
                in_context | ((new < widths[b]) & (seen[b, q_idx, entry] != 0)))
            if window is not None:
                key_position = torch.where(in_context, position, qpos[b, entry])
                ok = ok & (key_position > qpos[b, q_idx] - window)
            return ok
        return visible


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           sliding_window=None, softcap=None, sled_flex: FlexStep | None = None,
                           **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] of the packed new tokens -> ([1, T, H, D], None).
    Outside an engine step this is plain SDPA."""
    if sled_flex is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window,
                                      softcap=softcap, **kwargs)
    step, layer = sled_flex, module.layer_idx
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    step.pool.write(layer, step.write_slots.long(), key[0].transpose(0, 1),
                    value[0].transpose(0, 1))
    keys = step.pool.keys[layer].permute(1, 0, 2).unsqueeze(0)          # [1, KVH, S, D], a view
    values = step.pool.values[layer].permute(1, 0, 2).unsqueeze(0)
    padded = torch.cat([query[0], query.new_zeros(heads, 1, dim)], 1)   # [H, T + 1, D]
    out = query.new_zeros(tokens + 1, heads, dim)
    score_mod = _softcap(softcap) if softcap is not None else None
    for group in step.groups:        # a fixed list per bucket: no data-dependent control flow
        index = group.q_index.long()
        q = padded[:, index].transpose(0, 1)                              # [B, H, W, D]
        attn = step.flex(q, keys.to(q.dtype), values.to(q.dtype), score_mod=score_mod,
                         block_mask=group.block_mask(sliding_window, heads // keys.shape[1]),
                         scale=scaling, enable_gqa=keys.shape[1] != heads)
        out.index_copy_(0, index.reshape(-1), attn.transpose(1, 2).reshape(-1, heads, dim))
    return out[:tokens][None], None


def _softcap(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return score_mod


AttentionInterface.register(ATTENTION_NAME, flex_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)     # for use outside an engine step


class FlexEngine(Engine):
    kind = "flex"
    branches = True

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None,
                 flex=flex_attention) -> None:
        super().__init__(model, pool, sat)
        model.set_attn_implementation(ATTENTION_NAME)
        # Every slot holds finite values: a row's last block is read whole (its unwritten slots
        # masked), and a masked weight of 0 times a NaN is still NaN.
        for tensor in (*pool.keys, *pool.values):
            tensor.zero_()
        self.flex = flex
        self.kv_width = pool.num_blocks       # the CPU template needs the whole pool listed
        self.steps: dict[StepShape, FlexStep] = {}

    def step(self, rows: Sequence[Row]) -> FlexStep:
        """The bucket's buffers holding this step's plan, uploaded."""
        shape = step_shape([row.width for row in rows])
        if shape not in self.steps:
            self.steps[shape] = FlexStep(self.pool, shape, self.kv_width, self.device, self.flex)
        step = self.steps[shape]
        plan_step(rows, step.layout, step.host, self.pool.block_tokens, TRASH_SLOT)
        step.upload()
        for group in step.groups:
            group.refresh()
        return step

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        step = self.step(rows)
        index, spans = self._logit_index(rows)
        sat_at = sat_inputs(rows)
        ids = step.fields["ids"].long()[None]
        with self._sat_deltas([i for i, _ in sat_at]):
            out = self.model(**self._inputs(ids, [((0, i), slot) for i, slot in sat_at]),
                             position_ids=step.fields["positions"].long()[None],
                             attention_mask=NO_MASK.to(self.device), use_cache=False,
                             logits_to_keep=index.to(self.device), sled_flex=step)
        logits = out.logits[0]
        self.bytes_copied += sum(row.width for row in rows) * self.pool.shape.bytes_per_token
        return [None if span is None else logits[span].float() for span in spans]
