"""How flex's kernels walk one group of a step's bucket on CUDA: the key tile, whether the
row's committed context is passed as full blocks, and how many splits flex's decode kernel cuts
each row's blocks into.

flex's decode kernel (a short group: fewer than 128 queries a KV head) runs one program per
(row, KV head, split). Its split count is fixed when the bucket's kernel is compiled:

- "torch" (the default): torch's own choice, 2 x multiprocessors / (rows x KV heads), at least
  1, with full blocks where rows x KV heads fill the multiprocessors. With full blocks flex's
  decode kernel cuts the whole pool's length into the splits, not the row's blocks (its
  template's TILE_KV), so a row's blocks all land in one split; full blocks are then worth it
  only where a row is not split anyway.
- "auto": splits enough for PROGRAMS_PER_SM programs on every multiprocessor, at most
  MAX_SPLITS, cut from each row's own blocks (so no full blocks where it splits); where rows x
  KV heads already give that many programs, one split and full blocks.

The split count changes the order in which a row's keys are summed, never which keys a query
sees: every choice equals the paged engine within float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

SPLITS = ("torch", "auto")
PROGRAMS_PER_SM = 4      # "auto": decode programs per multiprocessor to keep its memory busy
MAX_SPLITS = 32          # "auto": the most splits of a row (each split's partial sums are kept)
MAX_BLOCK_N = 64         # the key tile: the pool's block, or this


@dataclass(frozen=True, slots=True)
class GroupKernel:
    """A group's kernel choice: full blocks or not, and flex's kernel_options (None: flex's
    defaults, off CUDA)."""
    full_blocks: bool
    options: dict | None


def group_kernel(sms: int, rows: int, kv_heads: int, block_tokens: int, short: bool,
                 full_blocks: bool = True, splits: str = "torch") -> GroupKernel:
    """The kernel choice of a group of `rows` rows over `kv_heads` KV heads on a GPU of `sms`
    multiprocessors (0: not CUDA); `short`: the group runs flex's decode kernel; `full_blocks`:
    whether full blocks are allowed at all."""
    if splits not in SPLITS:
        raise ValueError(f"unknown flex splits {splits!r}: use {' or '.join(SPLITS)}")
    if not sms:
        return GroupKernel(full_blocks, None)
    # the kernels' key tile must fit in the BlockMask's KV block, the pool's block (flex's main
    # kernel, for groups wider than its decode kernel takes, does not shrink its tile by itself)
    options = {"BLOCK_N": min(block_tokens, MAX_BLOCK_N)}
    programs = rows * kv_heads
    if splits == "torch" or not short:
        return GroupKernel(full_blocks and programs >= sms, options)
    split = min(-(-PROGRAMS_PER_SM * sms // programs), MAX_SPLITS)
    return GroupKernel(full_blocks and split == 1, {**options, "SPLIT_KV": split})

