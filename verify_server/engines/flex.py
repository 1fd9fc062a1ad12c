"""FlexEngine: attention reads the block pool in place through FlexAttention, in static shapes.

The paged engine (`verify_server.engines.paged.PagedEngine`) gathers every row's whole context out of
the pool for every layer and builds a dense mask each step; its step's shapes change with every
step, and boolean indexing makes the host wait for the device twice a layer. The flex engine
swaps only the attention function (registered through transformers' AttentionInterface, like
the paged one) and keeps the pool, the sessions' KV and the rounds as they are:

- each layer writes the new tokens' keys/values into their slots (`index_copy_`, inside sled's
  layer functions: `decoder.AroundAttention`; padding goes to the trash slot, the zero block's
  first) and calls `flex_attention` with the pool itself as K/V
  ([1, kv_heads, slots, head_dim], a view). A BlockMask built from the rows' block tables lists
  the blocks each row reads, and a mask_mod that is complete by itself (eager flex reads no block
  list) decides each (query, key): the key's block must be at that place of the row's table, then
  the context is visible, the new entries by the row's own visibility (chains, trees, SAT
  blocks), and the sliding window by position. Softcap is a score_mod;
- the step's shapes come from a bucket (`verify_server.flex_plan`): rows, width and tokens are
  padded, so every step of a bucket has the same shapes, the buffers are allocated once per
  bucket, and one host-to-device copy of one flat int32 buffer carries a whole step's plan;
- nothing in the forward reads a device value on the host: no boolean indexing, no `.item()`.

On CUDA the flex kernels skip every block a row does not list. On CPU `FlexEngine` runs eager flex
by default (dense over the pool: a test oracle on small pools); a server asked for flex on a CPU
(`serving_flex`) runs inductor's CPU flex kernel, which also reads only the listed blocks, once
a probe step has shown it exact there (`verify_server.flex_check`). `PagedEngine` stays the CPU
default.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch._dynamo.config as dynamo
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verify_server.engines import flex_graphs, visibility
from verify_server.engines.base import NO_MASK, Engine, StepLogits, logit_spans
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.decoder import AroundAttention, gather_queries, scatter_outputs
from verify_server.engines.flex_check import AttentionShape, refuse_if_unsound, vector_code
from verify_server.engines.flex_graphs import GraphMemory
from verify_server.engines.flex_kernels import SPLITS, group_kernel
from verify_server.engines.flex_plan import (SHORT_WIDTHS, StepLayout, StepShape, common_shapes,
                                             group_suffix, next_pow2, plan_step, prefill_shapes,
                                             step_shape)
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row, sat_inputs
from verify_server.sdsat import SatSpec

log = logging.getLogger("sled.server.flex")

ATTENTION_NAME = "sled_flex"
TRASH_SLOT = 0     # padding tokens' KV goes to the zero block's first slot, which flex never reads
LONG_Q_BLOCK = 128     # queries per BlockMask block: a long group's, and a short group's least


class FlexStep(AroundAttention):
    """A bucket's buffers: a pinned host buffer the planner fills, its device twin (one copy per
    step), and each field as a view of the device buffer. sled's forward writes the KV, gathers
    the queries and scatters the outputs inside its layer functions (`AroundAttention`)."""

    def __init__(self, pool: BlockPool, shape: StepShape, kv_width: int, device: torch.device,
                 flex=flex_attention, full_blocks: bool = True, long_flex=None,
                 splits: str = "torch") -> None:
        self.pool, self.shape, self.flex = pool, shape, flex
        self.long_flex = long_flex or flex      # the prefill chunks' group (FlexGroup.flex)
        self.full_blocks = full_blocks    # context blocks may skip the mask_mod (FlexGroup.kernel)
        self.splits = splits              # how the decode kernel splits a row (flex_kernels)
        self.sms = (torch.cuda.get_device_properties(device).multi_processor_count
                    if device.type == "cuda" else 0)
        self.layout = StepLayout(shape, kv_width, pool.num_blocks, len(pool.groups))
        pinned = device.type == "cuda"
        self.host_buffer = torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=pinned)
        self.host = self.layout.views(self.host_buffer.numpy())
        self.device_buffer = (torch.zeros_like(self.host_buffer, device=device) if pinned
                              else self.host_buffer)
        self.fields = self.layout.views(self.device_buffer)
        self.tokens = shape.tokens
        self.uploaded = None          # the event of an upload still in flight (CUDA)
        self.write_slots = tuple(self.fields[f"write_slots{group_suffix(k)}"]
                                 for k in range(len(pool.groups)))
        self.groups = [FlexGroup(self, g, group.width, long=g > 0 or not shape.short)
                       for g, group in enumerate(shape.groups)]
        self.q_index = tuple(group.q_index for group in self.groups)

    def attend(self, layer: int, queries, window: int | None, scaling: float | None,
               softcap: float | None = None) -> list[torch.Tensor]:
        """Each group's queries [B, H, W, D] through its flex over the pool in place."""
        keys = self.pool.keys[layer].permute(1, 0, 2).unsqueeze(0)      # [1, KVH, S, D], a view
        values = self.pool.values[layer].permute(1, 0, 2).unsqueeze(0)
        score_mod = _softcap(softcap) if softcap is not None else None
        outputs, kv_group = [], self.pool.group_of[layer]
        for group, q in zip(self.groups, queries):   # a fixed list per bucket
            heads = q.shape[1]
            outputs.append(group.flex(
                q, keys.to(q.dtype), values.to(q.dtype), score_mod=score_mod,
                block_mask=group.block_mask(kv_group, window, heads // keys.shape[1]),
                scale=scaling,
                enable_gqa=keys.shape[1] != heads, kernel_options=group.kernel.options))
        return outputs

    def clear(self, trash_slot: int) -> None:
        """An empty plan: every row padding, every token's KV to the trash slot."""
        for name, view in self.host.items():
            view[...] = -1 if name.startswith("table") else 0
            if name.startswith("q_index"):
                view[...] = self.tokens
            if name.startswith("write_slots"):
                view[...] = trash_slot

    def upload(self) -> None:
        if self.device_buffer is not self.host_buffer:
            self.device_buffer.copy_(self.host_buffer, non_blocking=True)
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()

    def writable(self) -> None:
        """Wait until the last upload has read the pinned buffer: the next plan rewrites it."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
            self.uploaded = None


class FlexGroup:
    """One group's views, and its BlockMask per layer group of the pool and sliding window
    (built once per bucket: the mask_mod reads the buffers, which each step rewrites in
    place)."""

    def __init__(self, step: FlexStep, g: int, width: int, long: bool = False) -> None:
        f = step.fields
        self.step, self.width = step, width
        self.flex = step.long_flex if long else step.flex
        # A short group's rows fit one query block (flex's decode kernel packs a KV head's
        # queries together); a long group's take flex's usual 128-query blocks, the same for
        # every width, so that one compiled flex serves prefill chunks of every length (at least
        # two: a dimension of size 1 would be compiled apart, as torch specialises size 1)
        self.long = long
        self.q_blocks = max(2, -(-width // LONG_Q_BLOCK)) if long else 1
        self.q_index = f[f"q_index{g}"]
        self.tables = [f[f"table{g}{group_suffix(k)}"] for k in range(len(step.pool.groups))]
        self.table, self.blocks = self.tables[0], f[f"blocks{g}"]
        self.starts, self.widths = f[f"starts{g}"], f[f"widths{g}"]
        self.qpos, self.seen = f[f"qpos{g}"], f[f"seen{g}"]
        self.block_pos = f["block_pos"]
        self.masks: dict[tuple[int, int | None], BlockMask] = {}
        # Full blocks pay only where the kernel walks a row's blocks unsplit (flex_kernels): with
        # fewer rows x KV heads than the GPU has multiprocessors flex splits them by pool length,
        # and the full-block lists then cost more than the mask they save (H200, llama-8b: 16
        # rows x 2048 ran 15.2 ms with full blocks, 12.6 without; 64 rows 20.6 against 22.8)
        self.kernel = group_kernel(step.sms, self.table.shape[0], step.pool.shape.local_kv_heads,
                                   step.pool.block_tokens, short=not long,
                                   full_blocks=step.full_blocks, splits=step.splits)
        self.full = self.kernel.full_blocks

    def block_mask(self, kv_group: int, window: int | None, heads_per_kv: int) -> BlockMask:
        """The BlockMask of the pool's layer group `kv_group` (its table) at `window`."""
        if (kv_group, window) not in self.masks:
            pool = self.step.pool
            rows = self.table.shape[0]
            # copies of the block lists (the table's -1 padding clamped: entries past a count are
            # never read): a mask_mod must not capture the BlockMask's own tensors
            partial, indices, full, full_indices = (
                self.per_q_block(t) for t in self.block_lists(kv_group, window))
            q_block = (LONG_Q_BLOCK if self.long
                       else max(LONG_Q_BLOCK, next_pow2(self.width * heads_per_kv)))
            self.masks[kv_group, window] = BlockMask.from_kv_blocks(
                partial, indices, *((full, full_indices) if full is not None else ()),
                BLOCK_SIZE=(q_block, pool.block_tokens),
                mask_mod=self.mask_mod(kv_group, window),
                seq_lengths=(self.width, pool.num_blocks * pool.block_tokens),
                compute_q_blocks=False)
        return self.masks[kv_group, window]

    def block_lists(self, kv_group: int, window: int | None):
        """(blocks whose every key the mask_mod decides, their pool indices, blocks every query
        of the row sees whole, theirs) per row. Full blocks are the row's committed context
        before its new entries' block (with no sliding window): flex skips the mask there. With
        full blocks off (or a window), every block is decided by the mask_mod: (.., None, None)."""
        table = self.tables[kv_group].clamp(min=0)
        if window is not None or not self.full:
            return self.blocks.clone(), table, None, None
        full = torch.minimum(self.starts // self.step.pool.block_tokens, self.blocks)
        places = torch.arange(table.shape[1], device=table.device, dtype=full.dtype)
        shifted = (places[None] + full[:, None]).clamp(max=table.shape[1] - 1)
        return self.blocks - full, table.gather(1, shifted.long()), full, table

    def per_q_block(self, lists: torch.Tensor | None) -> torch.Tensor | None:
        """A row's block count [B] or list [B, n] as a BlockMask holds it: the same for every
        query block of the row ([B, 1, q_blocks] or [B, 1, q_blocks, n])."""
        if lists is None:
            return None
        rows = lists.shape[0]
        return lists.view(rows, 1, 1, *lists.shape[1:]).expand(
            rows, 1, self.q_blocks, *lists.shape[1:]).contiguous()

    def refresh(self) -> None:
        """After a new plan: the BlockMasks hold copies of the block lists."""
        for (kv_group, window), mask in self.masks.items():
            partial, indices, full, full_indices = self.block_lists(kv_group, window)
            mask.kv_num_blocks.copy_(partial[:, None, None])       # broadcast over q blocks
            mask.kv_indices.copy_(indices[:, None, None])
            if full is not None:
                mask.full_kv_num_blocks.copy_(full[:, None, None])
                mask.full_kv_indices.copy_(full_indices[:, None, None])

    def mask_mod(self, kv_group: int, window: int | None):
        table, block_pos, blocks = self.tables[kv_group], self.block_pos, self.blocks
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
            return member & (q_idx < widths[b]) & visibility.attends(
                new, widths[b], seen[b, q_idx, entry] != 0, position, qpos[b, entry],
                qpos[b, q_idx], window)
        return visible


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           sliding_window=None, softcap=None, sled_flex: FlexStep | None = None,
                           **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] of the packed new tokens
    -> ([1, T, H, D], None).
    Outside an engine step this is plain SDPA."""
    if sled_flex is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window,
                                      softcap=softcap, **kwargs)
    step, layer = sled_flex, module.layer_idx
    step.pool.write(layer, step.slots_of(layer).long(), key[0].transpose(0, 1),
                    value[0].transpose(0, 1))
    queries = gather_queries(query[0].transpose(0, 1), step.q_index)
    outputs = step.attend(layer, queries, sliding_window, scaling, softcap)
    return scatter_outputs(outputs, step.q_index, query.shape[2])[None], None


def _softcap(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return score_mod


AttentionInterface.register(ATTENTION_NAME, flex_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)     # for use outside an engine step


class CapturedStep:
    """One bucket's whole forward captured in a CUDA graph: the model over the step's static
    buffers, then the argmax of every packed position. A replay reads the plan the last
    `FlexEngine.step` uploaded and leaves its logits and token ids in `logits` and `argmax`."""

    def __init__(self, engine: "FlexEngine", step: FlexStep, warmups: int = 2) -> None:
        self.step, self.graph = step, torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):     # compiles flex, builds the BlockMasks, outside capture
            for _ in range(warmups):
                engine.whole_step(step)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=engine.graph_pool,
                              capture_error_mode="thread_local"):
            self.logits, self.argmax = engine.whole_step(step)

    def replay(self) -> None:
        self.graph.replay()


class CompiledStep:
    """One bucket's whole forward through `torch.compile(mode="reduce-overhead")`, the other way
    to capture a step (`FlexEngine(capture="compile")`): inductor compiles the whole forward and
    records it in its own CUDA graph trees (on a CPU: compiled, no graph). Same interface as
    `CapturedStep`; `sled bench engine` weighs the two (flex-graph, flex-compile)."""

    def __init__(self, engine: "FlexEngine", step: FlexStep) -> None:
        self.step, self.run = step, engine.compiled_step
        engine.whole_step(step)         # eagerly once: builds the bucket's BlockMasks
        if step.device_buffer.is_cuda:
            # inputs the graph must read in place, not copy in: the pool and the plan
            for tensor in (*step.pool.keys, *step.pool.values, step.device_buffer,
                           *(t for g in step.groups for m in g.masks.values()
                             for t in (m.kv_indices, m.kv_num_blocks))):
                torch._dynamo.mark_static_address(tensor)
        self.replay()

    def replay(self) -> None:
        torch.compiler.cudagraph_mark_step_begin()     # the last step's outputs may be reused
        self.logits, self.argmax = self.run(self.step)


CAPTURES = {"graph": CapturedStep, "compile": CompiledStep}


class FlexEngine(Engine):
    """On CUDA: flex compiled (one kernel per bucket and window) and verify/decode steps (no
    prefill chunk, no SAT slot) replayed from a CUDA graph per bucket, captured the first time a
    bucket is met (or at start: `prewarm`). On CPU: eager flex, no graphs.

    `capture` says how a whole step is captured: "graph" (a `torch.cuda.CUDAGraph` around the
    forward with flex compiled) or "compile" (the whole forward through torch.compile's
    reduce-overhead mode, which on a CPU compiles without a graph)."""

    kind = "flex"
    branches = True
    own_forward = True

    def __init__(self, model: torch.nn.Module, pool: BlockPool, sat: SatSpec | None = None,
                 flex=None, graphs: bool | None = None, kv_width: int | None = None,
                 capture: str = "graph", forward: str = "sled", full_blocks: bool = True,
                 splits: str = "torch") -> None:
        super().__init__(model, pool, sat, forward)
        if splits not in SPLITS:
            raise ValueError(f"unknown flex splits {splits!r}: use {' or '.join(SPLITS)}")
        self.full_blocks, self.splits = full_blocks, splits
        self.activate()      # the pool is zero: every slot it reads holds a finite value
        cuda = self.device.type == "cuda"
        self.launches_ahead = cuda    # no step reads a device value on the host
        self.flex = flex or (compiled_flex() if cuda else flex_attention)
        # compiled static per bucket, prefill chunks (a long group: their lengths vary) excepted
        self.long_flex = compiled_flex(dynamic=True) if self.flex is compiled_flex() else self.flex
        if capture not in CAPTURES:
            raise ValueError(f"unknown capture {capture!r}: use {' or '.join(CAPTURES)}")
        self.graphs, self.capture = (cuda if graphs is None else graphs), CAPTURES[capture]
        if self.graphs and not cuda and capture == "graph":
            raise ValueError("CUDA graphs need a CUDA device: the flex engine on "
                             f"{self.device} runs without them")
        compiles = self.flex is not flex_attention or (self.graphs and capture == "compile")
        if compiles:
            _allow_recompiles(RECOMPILES)
        if compiles and not cuda:    # inductor's CPU kernel has been wrong (flex_check): probe it
            checked = compiled_flex() if self.flex is flex_attention else self.flex
            refuse_if_unsound(functools.partial(probe_error, checked, device=self.device),
                              AttentionShape.all_of(model, pool.block_tokens), self.device)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs and cuda else None
        self.compiled_step = None
        if capture == "compile":        # the whole step is compiled: its layers inside it
            self.compile_layers = False
        if self.graphs and capture == "compile":      # one graph per bucket
            self.compiled_step = torch.compile(   # static: one specialisation per bucket
                self.whole_step, fullgraph=True, dynamic=False,
                mode="reduce-overhead" if cuda else None)
        self.kv_width = kv_width or (_row_blocks(model, pool) if cuda else pool.num_blocks)
        self.steps: dict[StepShape, FlexStep] = {}
        self.captured: dict[StepShape, CapturedStep | CompiledStep] = {}
        self.mask = NO_MASK.to(self.device)

    def activate(self) -> None:
        self.model.set_attn_implementation(ATTENTION_NAME)

    def step(self, rows: Sequence[Row]) -> FlexStep:
        """The bucket's buffers holding this step's plan, uploaded."""
        step = self._buffers(step_shape([row.width for row in rows]))
        step.writable()
        plan_step(rows, step.layout, step.host, self.pool.block_tokens, TRASH_SLOT)
        self._upload(step)
        self.bytes_copied += sum(row.width for row in rows) * self.pool.shape.bytes_per_token
        return step

    def _buffers(self, shape: StepShape) -> FlexStep:
        if shape not in self.steps:
            self.steps[shape] = FlexStep(self.pool, shape, self.kv_width, self.device, self.flex,
                                         self.full_blocks, self.long_flex, self.splits)
        return self.steps[shape]

    @staticmethod
    def _upload(step: FlexStep) -> None:
        step.upload()
        for group in step.groups:
            group.refresh()

    def whole_step(self, step: FlexStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a planned step without SAT slots: logits [T, vocab] of every packed
        position, and their argmax [T]. What a captured step replays."""
        logits = self._logits(input_ids=step.fields["ids"].long()[None],
                              position_ids=step.fields["positions"].long()[None],
                              attention_mask=self.mask, use_cache=False, sled_flex=step)[0]
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def prewarm(self, shapes: Sequence[StepShape]) -> None:
        """Make these buckets ready now, over an empty plan (every row padding): a replayable
        one captured, any other run once, so that its compiled flex is compiled."""
        for shape in shapes:
            if self.graphs and shape.graphable:
                if shape not in self.captured:
                    self.captured[shape] = self.capture(self, self._empty(shape))
            elif self.long_flex is not flex_attention:
                self.whole_step(self._empty(shape))

    def _empty(self, shape: StepShape) -> FlexStep:
        step = self._buffers(shape)
        step.writable()
        step.clear(TRASH_SLOT)
        self._upload(step)
        return step

    def warm_up(self, max_rows: int, max_step_tokens: int) -> None:
        """Before serving, what the first requests would otherwise wait for: with graphs, a
        bucket of every power of two of rows up to `max_rows` captured, for drafts of up to 7
        tokens and up to 15 and for decode steps (flex compiled static per bucket: a bucket of
        another token count is then only captured, not compiled); the compiled flex of prefill
        chunks (one for every length: compiled at the shortest chunk and at the longest of
        `max_step_tokens`). The log says how many graphs it captured and the most there can be."""
        if self.graphs:       # a static kernel per bucket: rows of up to 8 and 16 entries
            verify = [*common_shapes(max_rows), *common_shapes(max_rows, SHORT_WIDTHS[0] + 1),
                      *common_shapes(max_rows, 1)]       # decode steps: the smallest buckets
        else:                 # one dynamic kernel (compiled apart for one row)
            verify = common_shapes(2)
        self.prewarm([*verify, *prefill_shapes(max_step_tokens)])
        log.info("flex engine: %s captured; steps of up to %d rows and %d tokens capture at "
                 "most %s", self.graph_memory(), max_rows, max_step_tokens,
                 self.graph_bound(max_rows, max_step_tokens))

    def graph_memory(self) -> GraphMemory:
        """The step graphs captured so far and about the memory they hold (flex_graphs); none
        off CUDA, where a step is compiled, never captured."""
        shapes = list(self.captured) if self.device.type == "cuda" else []
        return flex_graphs.estimate(self.model, shapes, self.kv_width, self.pool.num_blocks,
                                    len(self.pool.groups))

    def graph_bound(self, max_rows: int, max_step_tokens: int) -> GraphMemory:
        """The most step graphs steps of up to `max_rows` rows and `max_step_tokens` tokens
        capture, and their memory (every bucket met once)."""
        if not (self.graphs and self.device.type == "cuda"):
            return GraphMemory(0, 0)
        return flex_graphs.bound(self.model, max_rows, max_step_tokens, self.kv_width,
                                 self.pool.num_blocks, len(self.pool.groups))

    def replayable(self, rows: Sequence[Row]) -> bool:
        """Whether a step of these rows replays a captured graph: graphs on, no SAT slot, no
        prefill chunk."""
        return (self.graphs and not any(row.sat_slots for row in rows)
                and step_shape([row.width for row in rows]).graphable)

    def _replay(self, rows: Sequence[Row]) -> CapturedStep | CompiledStep:
        """Plan the rows into their bucket, capture it the first time, replay it."""
        step = self.step(rows)
        if step.shape not in self.captured:
            self.captured[step.shape] = self.capture(self, step)
        captured = self.captured[step.shape]
        captured.replay()
        return captured

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> StepLogits:
        """A replayable step: the captured step's logits of every packed position and their
        argmax, as they lie in its static buffers (read them before the next step). Otherwise
        one forward that keeps the logits the rows want."""
        self._fresh_decoder()
        if self.replayable(rows):
            captured = self._replay(rows)
            return StepLogits(captured.logits, _packed_spans(rows), captured.argmax)
        step = self.step(rows)
        index, spans = logit_spans(rows)
        sat_at = sat_inputs(rows)
        ids = step.fields["ids"].long()[None]
        with self._sat_deltas([i for i, _ in sat_at]):
            logits = self._logits(bool(sat_at), **self._inputs(ids, [((0, i), slot)
                                                                    for i, slot in sat_at]),
                                  position_ids=step.fields["positions"].long()[None],
                                  attention_mask=self.mask, use_cache=False,
                                  logits_to_keep=torch.tensor(index, device=self.device),
                                  sled_flex=step)
        return StepLogits(logits[0], spans)


@functools.cache
def compiled_flex(dynamic: bool = False):
    """flex_attention through torch.compile, static shapes: one kernel per bucket and window;
    `dynamic`: shapes symbolic, one kernel for groups of any size (the prefill chunks').
    Whole or not at all (fullgraph, and `_allow_recompiles` for the thread that runs it): a call
    dynamo did not compile would run flex eagerly, scoring every query against the whole pool
    (tens of GB for a server's pool), so it raises instead."""
    return torch.compile(flex_attention, dynamic=dynamic, fullgraph=True)


# inductor's CPU flex kernel takes these; other dtypes (float64) run flex eagerly
CPU_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Eager flex scores every query against the whole pool: past this many tokens a step's scores
# outgrow the memory the pool itself takes
EAGER_POOL_TOKENS = 1 << 16


def serving_flex(pool: BlockPool):
    """The flex attention a server runs over `pool`: compiled (on CUDA static, a kernel per
    bucket for its graph; on a CPU dynamic), except where torch's compiler does not take the
    pool's dtype on a CPU; eager flex there, on a pool small enough for it."""
    if pool.keys[0].device.type == "cuda":
        return compiled_flex()
    if pool.shape.dtype in CPU_COMPILED_DTYPES:     # no graphs on a CPU: one kernel for all
        return compiled_flex(dynamic=True)
    if pool.capacity_tokens > EAGER_POOL_TOKENS:
        raise ValueError(
            f"flex on a CPU runs {str(pool.shape.dtype).removeprefix('torch.')} targets eagerly, "
            f"scoring every query against the whole KV pool ({pool.capacity_tokens} tokens): "
            f"serve with --engine paged, a float32 target, or a KV pool of at most "
            f"{EAGER_POOL_TOKENS} tokens")
    return flex_attention


@functools.lru_cache(maxsize=None)
@torch.inference_mode()
def probe_error(flex, shape: AttentionShape, device: torch.device,
                code: str | None = None) -> float:
    """The largest difference between `flex` and eager flex on one probe step of every row kind
    (a chain, a decode row, a tree, a prefill chunk) over a fragmented probe pool with random KV,
    at `shape`; memoized per vector code (`code`, by default the one inductor picks now)."""
    if code is None and device.type == "cpu":
        return probe_error(flex, shape, device, vector_code())
    generator = torch.Generator().manual_seed(0)
    contexts = (29, max(shape.block_tokens - 3, 1), 47, shape.block_tokens)
    blocks = 1 + sum(-(-(n + PROBE_ROOM) // shape.block_tokens) for n in contexts)
    pool = BlockPool(KVShape(1, shape.kv_heads, shape.head_dim, shape.dtype), blocks,
                     shape.block_tokens, device)
    for tensor in (*pool.keys, *pool.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
        tensor[:shape.block_tokens] = 0                # the zero block stays zero
    kvs = _fragmented(pool, contexts)
    rows = [Row(kvs[0], [1, 2, 3, 4, 5], True), Row(kvs[1], [6], True),
            Row(kvs[2], [7, 8, 9, 10, 11], True, parents=(0, 1, 0, 3)),
            Row(kvs[3], list(range(40)), False)]
    tokens = sum(row.width for row in rows)
    bucket = step_shape([row.width for row in rows])
    q = torch.randn(1, shape.heads, bucket.tokens, shape.head_dim, generator=generator)
    k, v = (torch.randn(1, shape.kv_heads, bucket.tokens, shape.head_dim, generator=generator)
            for _ in range(2))
    kept = [t.clone() for t in (*pool.keys, *pool.values)]
    outputs = []
    for attend in (flex_attention, flex):
        for tensor, saved in zip((*pool.keys, *pool.values), kept):
            tensor.copy_(saved)
        step = FlexStep(pool, bucket, pool.num_blocks, device, attend)
        plan_step(rows, step.layout, step.host, pool.block_tokens, TRASH_SLOT)
        FlexEngine._upload(step)
        out, _ = flex_attention_forward(
            _ProbeLayer, *(x.to(device, shape.dtype) for x in (q, k, v)), None,
            scaling=shape.head_dim ** -0.5, sliding_window=shape.window, softcap=shape.softcap,
            sled_flex=step)
        outputs.append(out[0, :tokens].double())
    return float((outputs[1] - outputs[0]).abs().max())


PROBE_ROOM = 48       # tokens a probe session holds past its context: its row's entries


class _ProbeLayer:
    layer_idx = 0


def _fragmented(pool: BlockPool, contexts: Sequence[int]) -> list[SessionKV]:
    """Sessions with these committed contexts whose block tables interleave (grown a block at a
    time in turn)."""
    kvs = [SessionKV(pool) for _ in contexts]
    for kv, n in zip(kvs, contexts):
        kv.admit([], n + PROBE_ROOM, b"")
    for end in range(pool.block_tokens, max(contexts) + pool.block_tokens, pool.block_tokens):
        for kv, n in zip(kvs, contexts):
            kv.slots(0, min(end, n))
    for kv, n in zip(kvs, contexts):
        kv.commit(n)
    return kvs


# Entries a row may have past the context limit (a draft and SAT blocks after every cut).
OVERHANG = 512

# The compiled flex function is specialised per bucket shape and window (rows up to 64 in
# powers of two, three short widths, long groups, with and without a window): more than
# dynamo's default of 8 recompiles, after which it would run flex's dense path unannounced.
RECOMPILES = 256


def _allow_recompiles(count: int) -> None:
    """Dynamo's limits, in this thread's context (torch keeps them in context variables: a
    thread that runs steps must run them in this context, as the scheduler does); past them,
    an error, never flex run eagerly over the pool."""
    dynamo.recompile_limit = max(dynamo.recompile_limit, count)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, count)
    dynamo.fail_on_recompile_limit_hit = True


def _row_blocks(model: torch.nn.Module, pool: BlockPool) -> int:
    """The most blocks one row can list: its context limit and an overhang, in blocks (the CPU
    template instead needs the whole pool listed)."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None) or pool.capacity_tokens
    # a session reserves past the limit by its draft and SAT slots: room for them too
    return min(pool.num_blocks, -(-(limit + OVERHANG) // pool.block_tokens))


def _packed_spans(rows: Sequence[Row]) -> list[slice | None]:
    """Each row's slice of a value per packed position; None for a row that wants no logits."""
    spans, offset = [], 0
    for row in rows:
        spans.append(slice(offset, offset + row.width) if row.want_logits else None)
        offset += row.width
    return spans
