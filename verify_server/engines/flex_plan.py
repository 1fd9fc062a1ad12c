"""The flex engine's step plan, made in numpy: shapes from buckets, one flat host buffer.

A step packs its rows like the paged engine (`verify_server.engines.paged`): one sequence [1, T] of
every row's new tokens, each with its own position. For the flex engine the step then takes the
shape of a bucket, so that steps of one bucket have the same tensor shapes (one compiled
function and one CUDA graph each):

    tokens   T padded to the smallest of SMALL_TOKENS that holds the step, past those to a
             multiple of TOKEN_QUANTUM (padding writes to the trash slot): a one-row
             verify step's GEMMs run at 8 rows, not 32
    groups   the rows attended together, each padded to (rows B, width W):
               short  rows of up to SHORT_WIDTHS[-1] new entries (verify, decode, SAT, trees),
                      B a power of two, W the smallest of SHORT_WIDTHS that holds the widest
               long   rows with more (prefill chunks), B a power of two (at least 2: one
                      compiled flex serves every long group, and torch compiles size 1 apart),
                      W a power of two
    kv width every row's block table padded to the same number of blocks (kv_width)

Everything a step's attention reads lives in one flat int32 buffer (`StepLayout` names each
field's place), so a step is one host-to-device copy into the bucket's static device buffer:

    ids, positions, write_slots      [T]      the packed input and where its KV goes
    per group: q_index [B, W]        packed index of each query (T: padding, a zero query)
               table   [B, kv_width] logical block -> physical block (-1 past the row's blocks,
                                     and where a windowed layer group dropped one)
               blocks  [B]           blocks the row reads (context and its new entries)
               starts  [B]           committed length (the new entries' first place)
               widths  [B]           new entries (0: a padding row)
               qpos    [B, W]        position id of each new entry
               seen    [B, W, W]     new entry i sees new entry j (1/0)
    block_pos                [blocks] logical index of each physical block in its row's table

A pool with layer groups (`BlockPool.groups`: sliding windows) has a write_slots and a table
per layer group: those of group k > 0 are named with the suffix `_k{k}` (`group_suffix`).

Rows are planned with numpy and their Python lists, no torch call per row; their positions and
visibility come from `visibility.plan` (chains for all rows at once, branched rows one by one).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verify_server.engines import visibility

SHORT_WIDTHS = (8, 16, 32)
SMALL_TOKENS = (8, 16)      # token buckets under the quantum, for steps of a few rows
TOKEN_QUANTUM = 32


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_tokens(total: int) -> int:
    """The tokens T of the bucket that holds `total` packed tokens: the smallest of
    SMALL_TOKENS that holds them, past those a multiple of TOKEN_QUANTUM."""
    small = next((tokens for tokens in SMALL_TOKENS if total <= tokens), None)
    return small if small is not None else -(-total // TOKEN_QUANTUM) * TOKEN_QUANTUM


@dataclass(frozen=True, slots=True)
class GroupShape:
    rows: int       # B
    width: int      # W


@dataclass(frozen=True, slots=True)
class StepShape:
    """A bucket: the static shape of every step planned into it."""
    tokens: int                       # T
    groups: tuple[GroupShape, ...]    # (short, long), each present only when it has rows
    short: bool                       # whether the first group is the short rows'

    @property
    def graphable(self) -> bool:
        """Verify/decode steps (no long row): the steps worth a compiled function and a graph."""
        return self.short and len(self.groups) == 1


def step_shape(widths: Sequence[int]) -> StepShape:
    """The bucket of a step whose rows have these widths (new entries, SAT slots included)."""
    short = [w for w in widths if w <= SHORT_WIDTHS[-1]]
    long = [w for w in widths if w > SHORT_WIDTHS[-1]]
    groups = []
    if short:
        width = next(w for w in SHORT_WIDTHS if w >= max(short))
        groups.append(GroupShape(next_pow2(len(short)), width))
    if long:
        groups.append(GroupShape(max(2, next_pow2(len(long))), next_pow2(max(long))))
    return StepShape(bucket_tokens(sum(widths)), tuple(groups), bool(short))


def common_shapes(max_rows: int, width: int = 5) -> list[StepShape]:
    """The buckets of verify steps of 1, 2, 4, ... rows of `width` entries (k = 4 drafts), up
    to max_rows: what a server captures at start."""
    rows, shapes = 1, []
    while rows <= max_rows:
        shapes.append(step_shape([width] * rows))
        rows *= 2
    return shapes


def graphable_shapes(max_rows: int, max_step_tokens: int) -> list[StepShape]:
    """Every bucket a verify/decode step of up to `max_rows` rows and `max_step_tokens` tokens
    can fall in: the most CUDA graphs a server captures. A group of B rows holds B // 2 + 1 to
    B of them (one for B = 1), its width W holds a row wider than the next narrower width, so
    its steps pack from B // 2 + 1 + that narrower width tokens up to B x W."""
    shapes, rows = [], 1
    while rows <= next_pow2(max_rows):
        fewest, most = rows // 2 + 1, min(rows, max_rows)
        for narrower, width in zip((0, *SHORT_WIDTHS), SHORT_WIDTHS):
            least, largest = fewest + narrower, min(most * width, max_step_tokens)
            tokens = sorted({bucket_tokens(n) for n in range(least, largest + 1)})
            shapes.extend(StepShape(t, (GroupShape(rows, width),), True) for t in tokens)
        rows *= 2
    return shapes


def prefill_shapes(max_step_tokens: int) -> list[StepShape]:
    """Buckets of one prefill chunk, the shortest and the longest a step of `max_step_tokens`
    holds: the two a compiled flex for prefill chunks of every length is compiled at."""
    shortest = SHORT_WIDTHS[-1] + 1
    return [step_shape([width]) for width in dict.fromkeys((shortest, max(shortest, max_step_tokens)))]


class StepLayout:
    """Where each field of a bucket's steps sits in the flat int32 buffer."""

    def __init__(self, shape: StepShape, kv_width: int, num_blocks: int,
                 kv_groups: int = 1) -> None:
        self.shape, self.kv_width, self.num_blocks = shape, kv_width, num_blocks
        self.kv_groups = kv_groups
        self.fields: dict[str, tuple[int, tuple[int, ...]]] = {}
        size = 0

        def add(name: str, dims: tuple[int, ...]) -> None:
            nonlocal size
            self.fields[name] = (size, dims)
            size += int(np.prod(dims))

        T = shape.tokens
        for name in ("ids", "positions"):
            add(name, (T,))
        for k in range(kv_groups):
            add(f"write_slots{group_suffix(k)}", (T,))
        add("block_pos", (num_blocks,))
        for g, group in enumerate(shape.groups):
            B, W = group.rows, group.width
            add(f"q_index{g}", (B, W))
            for k in range(kv_groups):
                add(f"table{g}{group_suffix(k)}", (B, kv_width))
            for name in ("blocks", "starts", "widths"):
                add(f"{name}{g}", (B,))
            add(f"qpos{g}", (B, W))
            add(f"seen{g}", (B, W, W))
        self.size = size

    def views(self, flat):
        """Each field as a view of `flat` (a numpy array or a torch tensor of self.size)."""
        return {name: flat[start:start + int(np.prod(dims))].reshape(dims)
                for name, (start, dims) in self.fields.items()}


def group_suffix(k: int) -> str:
    """The suffix of layer group k's write_slots and tables in a StepLayout."""
    return f"_k{k}" if k else ""


def plan_step(rows, layout: StepLayout, host: dict[str, np.ndarray], block_tokens: int,
              trash_slot: int) -> None:
    """Fill the host views of `layout` (StepLayout.views of a numpy buffer) for these rows.
    Grows each row's block table for its new entries (SessionKV.slots) first."""
    bt, T = block_tokens, layout.shape.tokens
    widths = np.fromiter((row.width for row in rows), dtype=np.int64, count=len(rows))
    starts = np.fromiter((row.kv.length for row in rows), dtype=np.int64, count=len(rows))
    for row, start, width in zip(rows, starts, widths):
        row.kv.slots(int(start), int(start + width))          # allocate the blocks it will write
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
    total = int(widths.sum())
    if total > T:
        raise ValueError(f"{total} tokens do not fit the bucket's {T}")

    ids, positions = host["ids"], host["positions"]
    ids[:] = 0
    positions[:] = 0
    suffixes = [group_suffix(k) for k in range(layout.kv_groups)]
    for sfx in suffixes:
        host[f"write_slots{sfx}"][:] = trash_slot
    block_pos = host["block_pos"]

    short = widths <= SHORT_WIDTHS[-1]
    members = [np.flatnonzero(short), np.flatnonzero(~short)]
    members = [m for m in members if len(m)]
    for g, (_, index) in enumerate(zip(layout.shape.groups, members)):
        _plan_group(layout, g, [rows[i] for i in index], starts[index], widths[index],
                    offsets[index], bt, host)
    for row, offset in zip(rows, offsets):
        ids[offset:offset + len(row.tokens)] = row.tokens    # SAT slots stay 0: embeddings later
    for g in range(len(members)):
        q = host[f"q_index{g}"]
        live = q < T
        rows_of = np.broadcast_to(np.arange(q.shape[0])[:, None], q.shape)[live]
        entry = np.broadcast_to(np.arange(q.shape[1])[None, :], q.shape)[live]
        logical = host[f"starts{g}"][rows_of] + entry            # where the entry's KV goes
        positions[q[live]] = host[f"qpos{g}"][live]
        for sfx in suffixes:
            table = host[f"table{g}{sfx}"]
            listed = table >= 0
            block_pos[table[listed]] = np.broadcast_to(np.arange(table.shape[1]),
                                                       table.shape)[listed]
            host[f"write_slots{sfx}"][q[live]] = table[rows_of, logical // bt] * bt + logical % bt


def _plan_group(layout: StepLayout, g: int, rows, starts, widths, offsets, bt: int,
                host: dict[str, np.ndarray]) -> None:
    """Fill group g's views (its shape, the step's tokens T and kv_width from `layout`) for its
    rows: their committed lengths, widths and offsets in the packed sequence."""
    kv_width, T = layout.kv_width, layout.shape.tokens
    W = layout.shape.groups[g].width
    n = len(rows)
    q_index = host[f"q_index{g}"]
    blocks, starts_out, widths_out = host[f"blocks{g}"], host[f"starts{g}"], host[f"widths{g}"]
    qpos, seen = host[f"qpos{g}"], host[f"seen{g}"]
    cols = np.arange(W)
    inside = cols[None, :] < widths[:, None]                              # [n, W]
    q_index[:] = T
    q_index[:n] = np.where(inside, offsets[:, None] + cols[None, :], T)
    for k in range(layout.kv_groups):
        table = host[f"table{g}{group_suffix(k)}"]
        table[:] = -1
        for b, row in enumerate(rows):
            blocks_k = row.kv.tables[k]
            if len(blocks_k) > kv_width:
                raise ValueError(f"a row of {len(blocks_k)} blocks passes the step's "
                                 f"{kv_width} (the engine's kv_width)")
            table[b, :len(blocks_k)] = blocks_k
        table[table == 0] = -1        # a block a windowed group dropped (kv.DROPPED): none read
    blocks[:] = 0
    blocks[:n] = -(-(starts + widths) // bt)
    starts_out[:] = 0
    starts_out[:n] = starts
    widths_out[:] = 0
    widths_out[:n] = widths
    qpos[:] = 0
    seen[:] = 0
    qpos[:n], seen[:n] = visibility.plan(rows, starts, widths, W)
