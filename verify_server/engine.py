"""The batched forward: every scheduled session's new tokens through the target in one pass.

Sessions' keys/values live in the block pool (`blocks.py`). A forward writes each row's new tokens
into the slots after its session's committed length and leaves that length alone: what a round
keeps is committed afterwards (`SessionKV.commit`), the rest is overwritten by the next forward.
Two engines share the pool:

- `PagedEngine` (the fast path): the new tokens of all rows are packed into one ragged sequence
  [1, T] with each token's own position id. A registered attention function writes each layer's
  new keys/values straight into the rows' slots and attends over each row's slots. Per step the
  only KV bytes written are the new tokens'; logits are computed only where a row wants them.
- `PaddedEngine` (the generic fallback, for architectures that do not route attention through
  transformers' attention interface): gathers the rows' KV into a left-padded transformers cache,
  runs the model, and writes the new tokens back into the pool. Correct for any decoder, but it
  copies every row's context each step.

    rows:  a (past 3, new 2)   b (past 1, new 3)
    packed input ids:  a a b b b      positions:  3 4 1 2 3
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sled.wire.tree import depths
from verify_server.blocks import BlockPool, KVShape
from verify_server.kv import SessionKV
from verify_server.sdsat import SatSpec

ATTENTION_NAME = "sled_paged"
SHORT_ROW = 64   # rows up to this many new tokens share one padded attention call


@dataclass(slots=True)
class Row:
    """One session's new tokens in a step, and the SAT slots after them.

    SAT slots come in blocks of `sat_slots`. A block follows the first `a` of the row's tokens
    (its anchor): its slots sit at the positions after token a - 1 and see the context, those a
    tokens and their own block's earlier slots, nothing else. The default is one block after
    all the tokens. Several anchors give the SAT guesses for every place a draft may be cut:

        tokens  t g1 g2          anchors (1, 2, 3), m = 2
        block 1 sees t           -> guesses if no draft token is accepted
        block 2 sees t g1        -> ... if g1 is
        block 3 sees t g1 g2     -> ... if both are
    """
    kv: SessionKV
    tokens: Sequence[int]     # new tokens, written after kv.length
    want_logits: bool         # False for prefill: only the KV is needed
    sat_slots: int = 0        # SAT slots per block (their KV is dropped later)
    sat_anchors: tuple[int, ...] = ()   # tokens each block follows; () = one block after all
    # A tree draft (sled.wire.tree): the parent of each of tokens[1:], 0 = tokens[0], i = tokens[i];
    # each token then sees its ancestors only. () = a chain. Trees carry no SAT slots.
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.parents and self.sat_slots:
            raise ValueError("a tree draft carries no SAT slots")

    @property
    def blocks(self) -> tuple[int, ...]:
        if not self.sat_slots:
            return ()
        return self.sat_anchors or (len(self.tokens),)

    @property
    def width(self) -> int:
        return len(self.tokens) + len(self.blocks) * self.sat_slots

    @property
    def branched(self) -> bool:
        """Whether some SAT slot does not simply follow everything before it (a tree, not a chain)."""
        return bool(self.parents) or self.blocks not in ((), (len(self.tokens),))

    def positions(self, start: int) -> torch.Tensor:
        """[width] position ids of the tokens, then of each block's slots."""
        n, m = len(self.tokens), self.sat_slots
        if self.parents:
            return start + torch.tensor([0, *depths(self.parents)])
        return torch.cat([torch.arange(start, start + n),
                          *(torch.arange(start + a, start + a + m) for a in self.blocks)])

    def visible(self) -> torch.Tensor:
        """[width, width] bool: which of the row's new entries each one attends to."""
        n, m = len(self.tokens), self.sat_slots
        seen = torch.zeros(self.width, self.width, dtype=torch.bool)
        if self.parents:
            seen[0, 0] = True
            for i, parent in enumerate(self.parents, start=1):   # parents come first
                seen[i] = seen[parent]
                seen[i, i] = True
            return seen
        seen[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        for b, anchor in enumerate(self.blocks):
            first = n + b * m
            seen[first:first + m, :anchor] = True
            seen[first:first + m, first:first + m] = torch.ones(m, m, dtype=torch.bool).tril()
        return seen


class Engine:
    """Owns the block pool and runs one forward per scheduler step."""

    kind = "base"
    branches = False     # whether rows may branch: SAT blocks (Row.sat_anchors), trees (Row.parents)

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None) -> None:
        self.model = model
        self.pool = pool
        self.sat = sat          # the target's semantic adaptive tokens, if it has them
        self.device = next(model.parameters()).device
        self.bytes_copied = 0   # KV bytes written or copied outside attention, ever
        if sat is not None and sat.lora is not None:
            sat.lora.attach(model)   # its deltas act only inside `_sat_deltas`

    def _sat_deltas(self, flat_positions: list[int]):
        """The pass inside applies the SAT LoRA deltas at these positions of the flattened input
        (a no-op context when the target's SATs have no deltas)."""
        if self.sat is None or self.sat.lora is None:
            return nullcontext()
        return self.sat.lora.at(torch.tensor(flat_positions, dtype=torch.long, device=self.device))

    def _inputs(self, input_ids: torch.Tensor, sat_at: list[tuple[tuple[int, ...], int]]) -> dict:
        """Model inputs: plain ids, or embeddings with SAT slots written in at `sat_at`
        (index into input_ids, slot number) when a row asked for SATs."""
        input_ids = input_ids.to(self.device)
        if not sat_at:
            return {"input_ids": input_ids}
        if self.sat is None:
            raise RuntimeError("SAT slots requested but the target has no SATs")
        embeds = self.model.get_input_embeddings()(input_ids)
        slots = self.sat.slot_embeddings(self.model, max(slot for _, slot in sat_at) + 1)
        for index, slot in sat_at:
            embeds[index] = slots[slot].to(embeds.dtype)
        return {"inputs_embeds": embeds}

    def new_kv(self) -> SessionKV:
        return SessionKV(self.pool)

    def activate(self) -> None:
        """Route the model's attention to this engine (engines that share one model object, as
        a benchmark's do, take turns)."""

    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """One pass over all rows; returns logits [row.width, vocab] for rows that want them.
        Each row's KV is written after kv.length; no row's length changes."""
        raise NotImplementedError

    def _logit_index(self, rows: Sequence[Row]) -> tuple[torch.Tensor, list[slice | None]]:
        """Packed positions whose logits are needed, and each row's slice of them."""
        index, spans, offset, kept = [], [], 0, 0
        for row in rows:
            n = row.width
            if row.want_logits:
                index.extend(range(offset, offset + n))
                spans.append(slice(kept, kept + n))
                kept += n
            else:
                spans.append(None)
            offset += n
        return torch.tensor(index or [offset - 1], dtype=torch.long), spans


def sat_inputs(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """(packed index, slot number) of every SAT slot of a step's rows, packed as the engines
    pack them: each row's tokens, then its SAT blocks."""
    at, offset = [], 0
    for row in rows:
        n = len(row.tokens)
        at.extend((offset + i, (i - n) % row.sat_slots) for i in range(n, row.width))
        offset += row.width
    return at


# --- the paged fast path -------------------------------------------------------------------------

@dataclass(slots=True)
class _Group:
    """Rows attended together: their queries padded to one width and their slots to one length."""
    q_index: torch.Tensor     # [B, W] packed position of each query (padding -> 0)
    q_valid: torch.Tensor     # [B, W]
    read_slots: torch.Tensor  # [B, L] pool slots of each row's context (padding -> the zero slot)
    query_pos: torch.Tensor   # [B, W] absolute position of each query
    key_len: torch.Tensor     # [B] context length after this step
    tree: tuple | None = None   # branched rows: (starts [B], key_pos [B, L], seen [B, W, W])
    masks: dict = field(default_factory=dict)   # sliding window (or None) -> [B, 1, W, L]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks and self.tree is not None:
            self.masks[window] = self._tree_mask(window)
        if window not in self.masks:
            keys = torch.arange(self.read_slots.shape[1], device=self.read_slots.device)
            q = self.query_pos[:, :, None]
            allowed = (keys[None, None, :] <= q) & (keys[None, None, :] < self.key_len[:, None, None])
            if window is not None:
                allowed &= keys[None, None, :] > q - window
            allowed &= self.q_valid[:, :, None]
            allowed[..., 0] |= ~self.q_valid  # padding queries look at the zero slot: no NaN
            self.masks[window] = allowed[:, None]
        return self.masks[window]

    def _tree_mask(self, window: int | None) -> torch.Tensor:
        """The mask when some row is branched: the context before a row's new entries is
        visible to all of them; among the new entries, what `seen` allows; the window by
        position (a SAT slot's position is not its place in the pool)."""
        starts, key_pos, seen = self.tree
        keys = torch.arange(self.read_slots.shape[1], device=self.read_slots.device)[None, :]
        new = (keys - starts[:, None]).clamp(0, seen.shape[2] - 1)          # [B, L]
        among_new = torch.gather(seen, 2, new[:, None, :].expand(-1, seen.shape[1], -1))
        allowed = torch.where((keys < starts[:, None])[:, None, :], True, among_new)
        allowed &= (keys < self.key_len[:, None])[:, None, :]
        if window is not None:
            allowed &= key_pos[:, None, :] > self.query_pos[:, :, None] - window
        allowed &= self.q_valid[:, :, None]
        allowed[..., 0] |= ~self.q_valid
        return allowed[:, None]


@dataclass(slots=True)
class _Step:
    pool: BlockPool
    write_slots: torch.Tensor   # [T]
    groups: list[_Group]
    tokens: int


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
    step.pool.write(layer, step.write_slots, new_k, new_v)
    out = query.new_empty(step.tokens, query.shape[1], query.shape[3])  # [T, H, D]
    for group in step.groups:
        q = query[0][:, group.q_index].transpose(0, 1)                   # [B, H, W, D]
        k, v = step.pool.read(layer, group.read_slots)                    # [B, L, KVH, D]
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        mask = group.mask(sliding_window)
        if softcap is None:
            attn = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        else:
            attn = _softcapped_attention(q, k, v, mask, scaling, softcap)
        attn = attn.transpose(1, 2)                                       # [B, W, H, D]
        out[group.q_index[group.q_valid]] = attn[group.q_valid]
    return out[None], None


def _softcapped_attention(q, k, v, mask, scaling, softcap):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


AttentionInterface.register(ATTENTION_NAME, paged_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)   # for use outside an engine step
# Passed as the attention mask inside a step: transformers returns a 4D mask as-is, so no
# [tokens, tokens] mask is built; paged_attention builds its own per-row masks.
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


class PagedEngine(Engine):
    kind = "paged"
    branches = True

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None) -> None:
        super().__init__(model, pool, sat)
        self.activate()

    def activate(self) -> None:
        self.model.set_attn_implementation(ATTENTION_NAME)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return bool(getattr(model, "_supports_attention_backend", False))

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        step, input_ids, position_ids, sat_at = self._plan(rows)
        index, spans = self._logit_index(rows)
        with self._sat_deltas([i for i, _ in sat_at]):
            out = self.model(**self._inputs(input_ids[None], [((0, i), slot) for i, slot in sat_at]),
                             position_ids=position_ids[None].to(self.device),
                             attention_mask=NO_MASK.to(self.device),
                             use_cache=False, logits_to_keep=index.to(self.device), sled_step=step)
        logits = out.logits[0]
        self.bytes_copied += step.tokens * self.pool.shape.bytes_per_token
        return [None if span is None else logits[span].float() for span in spans]

    def _plan(self, rows: Sequence[Row]):
        ids, positions, writes, offsets = [], [], [], []
        offset = 0
        for row in rows:
            start, n = row.kv.length, row.width
            ids.extend(row.tokens)
            ids.extend([0] * (n - len(row.tokens)))  # placeholders: their embeddings are the SATs'
            positions.append(row.positions(start))
            writes.append(row.kv.slots(start, start + n))
            offsets.append(offset)
            offset += n
        short = [b for b, row in enumerate(rows) if row.width <= SHORT_ROW]
        long = [[b] for b, row in enumerate(rows) if row.width > SHORT_ROW]
        groups = [self._group([rows[b] for b in members], [offsets[b] for b in members],
                              [positions[b] for b in members])
                  for members in ([short] if short else []) + long]
        dev = self.device
        step = _Step(self.pool, torch.cat(writes).to(dev), groups, offset)
        return step, torch.tensor(ids, dtype=torch.long), torch.cat(positions), sat_inputs(rows)

    def _group(self, rows: Sequence[Row], offsets: Sequence[int],
               positions: Sequence[torch.Tensor]) -> _Group:
        """positions: each row's position ids (Row.positions), as the packed input has them."""
        width = max(row.width for row in rows)
        length = max(row.kv.length + row.width for row in rows)
        q_index = torch.zeros(len(rows), width, dtype=torch.long)
        q_valid = torch.zeros(len(rows), width, dtype=torch.bool)
        query_pos = torch.zeros(len(rows), width, dtype=torch.long)
        read_slots = torch.zeros(len(rows), length, dtype=torch.long)  # slot 0: the zero block
        key_len = torch.zeros(len(rows), dtype=torch.long)
        for b, (row, offset, position) in enumerate(zip(rows, offsets, positions)):
            start, n = row.kv.length, row.width
            q_index[b, :n] = torch.arange(offset, offset + n)
            q_valid[b, :n] = True
            query_pos[b, :n] = position
            read_slots[b, :start + n] = row.kv.slots(0, start + n)
            key_len[b] = start + n
        dev = self.device
        tree = self._tree(rows, query_pos, length, width) if any(r.branched for r in rows) else None
        return _Group(q_index.to(dev), q_valid.to(dev), read_slots.to(dev), query_pos.to(dev),
                      key_len.to(dev), tree=tree and tuple(t.to(dev) for t in tree))

    @staticmethod
    def _tree(rows: Sequence[Row], query_pos: torch.Tensor, length: int, width: int):
        """(starts, key_pos, seen) of a group with branched rows (see _Group._tree_mask)."""
        starts = torch.tensor([row.kv.length for row in rows], dtype=torch.long)
        key_pos = torch.arange(length).repeat(len(rows), 1)
        seen = torch.zeros(len(rows), width, width, dtype=torch.bool)
        for b, row in enumerate(rows):
            start, n = row.kv.length, row.width
            key_pos[b, start:start + n] = query_pos[b, :n]
            seen[b, :n, :n] = row.visible()
        return starts, key_pos, seen


# --- the generic fallback -------------------------------------------------------------------------

class PaddedEngine(Engine):
    kind = "padded"

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
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
        logits: list[torch.Tensor | None] = []
        for b, (row, width) in enumerate(zip(rows, widths)):
            start = row.kv.length
            slots = row.kv.slots(start, start + width).to(self.device)
            for layer, cached in enumerate(cache.layers[: self.pool.shape.layers]):
                new = slice(max_past, max_past + width)
                self.pool.write(layer, slots, cached.keys[b, :, new].transpose(0, 1),
                                cached.values[b, :, new].transpose(0, 1))
            self.bytes_copied += width * self.pool.shape.bytes_per_token
            logits.append(out.logits[b, :width].float() if row.want_logits else None)
        return logits

    def _padded_cache(self, rows: Sequence[Row], max_past: int) -> DynamicCache:
        """The rows' KV, left-padded to max_past, as one transformers cache (a copy)."""
        if max_past == 0:
            return DynamicCache()
        layers = []
        for layer in range(self.pool.shape.layers):
            keys = self.pool.keys[layer].new_zeros(
                (len(rows), self.pool.shape.kv_heads, max_past, self.pool.shape.head_dim))
            values = torch.zeros_like(keys)
            for b, row in enumerate(rows):
                if row.kv.length:
                    k, v = self.pool.read(layer, row.kv.slots(0, row.kv.length).to(self.device))
                    keys[b, :, max_past - row.kv.length:] = k.transpose(0, 1)
                    values[b, :, max_past - row.kv.length:] = v.transpose(0, 1)
                    self.bytes_copied += k.nbytes + v.nbytes
            layers.append((keys, values))
        return DynamicCache(layers)


# --- sizing ---------------------------------------------------------------------------------------

def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read available memory from /proc/meminfo")


def make_engine(model: torch.nn.Module, *, kv_budget_bytes: int | None = None,
                kv_fraction: float = 0.25, block_tokens: int = 16, kind: str = "auto",
                sat: SatSpec | None = None) -> Engine:
    """An engine over a pool of `kv_budget_bytes` (default: `kv_fraction` of free memory);
    `sat`: the target's SATs, for rows that append SAT slots."""
    shape = KVShape.of(model)
    device = next(model.parameters()).device
    budget = kv_budget_bytes if kv_budget_bytes is not None else int(free_memory_bytes(device) * kv_fraction)
    # Block 0 is the zero block that padding reads; it is never handed to a session.
    blocks = budget // (block_tokens * shape.bytes_per_token)
    if blocks < 2:
        raise ValueError(f"KV budget {budget} bytes holds less than one block of {block_tokens} tokens "
                         f"({block_tokens * shape.bytes_per_token} bytes)")
    if kind not in ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}: use {', '.join(ENGINES)}")
    pool = BlockPool(shape, blocks, block_tokens, device)
    if kind == "auto":
        kind = auto_kind(model, device)
    if kind == "flex":
        from verify_server.flex import FlexEngine, serving_flex

        return FlexEngine(model, pool, sat, flex=serving_flex(pool))
    return {"paged": PagedEngine, "padded": PaddedEngine}[kind](model, pool, sat)


ENGINES = ("auto", "paged", "flex", "padded")


def auto_kind(model: torch.nn.Module, device: torch.device) -> str:
    """flex on CUDA, paged on CPU, padded for a model without transformers' attention interface."""
    if not PagedEngine.supports(model):
        return "padded"
    return "flex" if device.type == "cuda" else "paged"
