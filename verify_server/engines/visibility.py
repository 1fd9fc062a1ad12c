"""What each new entry of a step attends to: the one home of the attention rules.

A row (`rows.Row`) feeds new entries after its session's committed context: its tokens, then its
SAT slot blocks. The rules:

    context   every new entry sees the session's whole committed context
    chain     new entry i sees new entries 0..i, at position start + i
    tree      a node sees its ancestors and itself, at the position of its depth (Row.parents)
    SAT       a block's slots see the first `anchor` tokens and their own block's earlier slots,
              at the positions after the anchor (Row.sat_anchors)
    window    a sliding-window layer sees only keys whose position is within `window` of the
              query's (a new entry's position is its position id, not its place in the pool)

`positions` and `seen` state the chain, tree and SAT rules for one row; `plan` states them for
a group of rows at once (chains vectorized in numpy, only branched rows asked one by one);
`attends` adds the context and window rules, elementwise over tensors, so the paged engine's
dense masks and the flex engine's mask_mod evaluate the very same expression.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sled.wire.tree import depths
from verify_server.engines.rows import Row


def positions(row: Row, start: int) -> np.ndarray:
    """[width] position ids of the row's tokens, then of each SAT block's slots."""
    n, m = len(row.tokens), row.sat_slots
    if row.parents:
        return start + np.array([0, *depths(row.parents)], dtype=np.int64)
    return np.concatenate([np.arange(start, start + n),
                           *(np.arange(start + a, start + a + m) for a in row.blocks)])


def seen(row: Row) -> np.ndarray:
    """[width, width] bool: which of the row's new entries each one attends to."""
    n, m = len(row.tokens), row.sat_slots
    out = np.zeros((row.width, row.width), dtype=bool)
    if row.parents:
        out[0, 0] = True
        for i, parent in enumerate(row.parents, start=1):   # parents come first
            out[i] = out[parent]
            out[i, i] = True
        return out
    out[:n, :n] = np.tri(n, dtype=bool)
    for b, anchor in enumerate(row.blocks):
        first = n + b * m
        out[first:first + m, :anchor] = True
        out[first:first + m, first:first + m] = np.tri(m, dtype=bool)
    return out


def plan(rows: Sequence[Row], starts: np.ndarray, widths: np.ndarray,
         width: int) -> tuple[np.ndarray, np.ndarray]:
    """Position ids [n, width] and visibility [n, width, width] of rows padded to `width`
    entries (padding: position 0, seeing and seen by nothing), given each row's committed
    length and width."""
    cols = np.arange(width)
    inside = cols[None, :] < widths[:, None]                              # [n, W]
    qpos = np.where(inside, starts[:, None] + cols[None, :], 0)
    out = np.tri(width, dtype=bool)[None] & inside[:, None, :] & inside[:, :, None]
    for b, row in enumerate(rows):
        if row.branched:
            w = row.width
            qpos[b, :w] = positions(row, int(starts[b]))
            out[b, :w, :w] = seen(row)
    return qpos, out


def attends(new, width, seen_entry, context_position, entry_position, query_position,
            window: int | None):
    """Whether a query attends to a key, elementwise over broadcastable tensors.

    new: the key's place after the row's start (< 0: in the committed context); width: the
    row's new entries; seen_entry: `seen` at (query, the key's entry); context_position: the
    key's position if it is in the context; entry_position: its position id if it is a new
    entry; query_position: the query's position id."""
    in_context = new < 0
    ok = in_context | ((new < width) & seen_entry)
    if window is not None:
        key_position = torch.where(in_context, context_position, entry_position)
        ok = ok & (key_position > query_position - window)
    return ok
