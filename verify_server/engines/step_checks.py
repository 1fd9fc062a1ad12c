"""What a following rank of a split server takes from rank 0 (engines.sharded): each message
checked against the rank's own limits before any of it is acted on.

The layout (step_messages) says what a message is; its limits say whether this rank may act on
it, and none of them is rank 0's word: a step's rows and entries, the pool's block size and
engine come from the rank's own settings, token ids and SAT slots from its target, the pool's
bytes from the free memory the ranks reported, block ids and slots from the pool it made.

    a pool of 8 blocks of 16 slots: a row's table holds blocks 1..7 (block 0 is the zero block
    padding reads, never a session's); a row of 5 entries after 20 tokens needs 2 of them
    (25 <= 2 * 16); a Copy moves slots 16..127 only
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sled.wire.tree import tree_problem
from verify_server.engines.blocks import BlockPool
from verify_server.engines.step_messages import (
    ROW_FIELDS, Copy, PoolSize, RowPlan, Step, Stop, WarmUp)


class OutOfBounds(ValueError):
    """A message in the layout that this rank cannot act on: nothing of it is."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A following rank's own bounds on rank 0's messages."""
    max_rows: int            # rows of a step (sled serve: --max-batch-sessions)
    max_step_tokens: int     # entries of one row (--max-step-tokens)
    block_tokens: int        # the pool's block (--kv-block-tokens)
    engine: str              # the engine kind this rank picks ("auto" resolved here)
    vocab_size: int          # the target's
    sat_slots: int           # the target's SAT slots (0: none)
    pool_bytes: int          # the largest pool the ranks' free memory holds (Ranks.kv_budget)
    num_blocks: int = 0      # the pool's, once made; before, nothing but a PoolSize is read

    def with_pool(self, pool: BlockPool) -> "Limits":
        return replace(self, num_blocks=pool.num_blocks)

    @property
    def table_blocks(self) -> int:
        """The longest block table: every block a session may hold."""
        return max(self.num_blocks - 1, 0)

    def max_values(self, kind: type) -> int:
        """The longest payload of a `kind` message within these limits: what a receiver
        allocates at most before it reads one."""
        if kind is Step:        # rows; per row its fields, table, tokens and anchors or parents
            return 1 + self.max_rows * (ROW_FIELDS + self.table_blocks + 2 * self.max_step_tokens)
        if kind is Copy:        # a tree's accepted path, within one row
            return 2 * self.max_step_tokens
        return {WarmUp: 2, PoolSize: 3, Stop: 0}[kind]


def check(message, limits: Limits) -> None:
    """OutOfBounds (one line) unless this rank can act on all of `message`."""
    if limits.num_blocks == 0 and not isinstance(message, (PoolSize, Stop)):
        raise OutOfBounds(f"a {type(message).__name__} before the pool's size")
    _CHECKS[type(message)](message, limits)


def _check_step(step: Step, limits: Limits) -> None:
    if len(step.rows) > limits.max_rows:
        raise OutOfBounds(f"a step of {len(step.rows)} rows (at most {limits.max_rows})")
    for i, plan in enumerate(step.rows):
        problem = (_sat_problem(plan, limits) or _table_problem(plan, limits)
                   or _entries_problem(plan, limits))
        if problem:
            raise OutOfBounds(f"row {i} of a step: {problem}")


def _sat_problem(plan: RowPlan, limits: Limits) -> str | None:
    """What makes `plan`'s SAT blocks none the target has slots for."""
    if plan.sat_slots > limits.sat_slots:
        return f"{plan.sat_slots} SAT slots (the target has {limits.sat_slots})"
    anchors = plan.sat_anchors
    if not anchors:
        return None
    if not plan.sat_slots:
        return "SAT anchors without SAT slots"
    if anchors[0] < 1 or anchors[-1] > len(plan.tokens) or \
            any(b <= a for a, b in zip(anchors, anchors[1:])):
        return f"SAT anchors {anchors}: not increasing within its {len(plan.tokens)} tokens"
    return None


def _table_problem(plan: RowPlan, limits: Limits) -> str | None:
    """What keeps `plan`'s table off this rank's pool, or its entries off its table."""
    table = plan.table
    if len(table) > limits.table_blocks:
        return f"a table of {len(table)} blocks (the pool has {limits.table_blocks})"
    lowest, highest = (min(table), max(table)) if table else (1, 1)
    if lowest < 1 or highest >= limits.num_blocks:
        bad = lowest if lowest < 1 else highest
        return f"block {bad} in its table (the pool's are 1..{limits.num_blocks - 1})"
    width = _width(plan)
    if not 1 <= width <= limits.max_step_tokens:
        return f"{width} entries (1..{limits.max_step_tokens} a row)"
    if plan.length + width > len(table) * limits.block_tokens:
        return (f"{width} entries after {plan.length} tokens, past its table's "
                f"{len(table) * limits.block_tokens} slots")
    return None


def _entries_problem(plan: RowPlan, limits: Limits) -> str | None:
    """What makes `plan`'s tokens or tree none the target can take."""
    if plan.tokens and max(plan.tokens) >= limits.vocab_size:
        return f"token id {max(plan.tokens)} (the vocabulary has {limits.vocab_size})"
    if plan.parents:
        problem = "a tree with SAT slots" if plan.sat_slots else \
            tree_problem(plan.parents, len(plan.tokens) - 1)
        if problem:
            return f"a tree that is none ({problem})"
    return None


def _width(plan: RowPlan) -> int:
    """The row's entries, as Row.width counts them (its SAT slots checked first)."""
    return len(plan.tokens) + (len(plan.sat_anchors) or 1) * plan.sat_slots


def _check_copy(copy: Copy, limits: Limits) -> None:
    if len(copy.source) > limits.max_step_tokens:
        raise OutOfBounds(f"a Copy of {len(copy.source)} slots (a tree's path moves at most "
                          f"{limits.max_step_tokens})")
    _check_slots(copy.source, limits)
    _check_slots(copy.dest, limits)


def _check_slots(slots: Sequence[int], limits: Limits) -> None:
    first, end = limits.block_tokens, limits.num_blocks * limits.block_tokens
    if slots and not (first <= min(slots) and max(slots) < end):
        bad = min(slots) if min(slots) < first else max(slots)
        raise OutOfBounds(f"slot {bad} in a Copy (the sessions' are {first}..{end - 1})")


def _check_warm_up(warm: WarmUp, limits: Limits) -> None:
    if warm.max_rows > limits.max_rows or warm.max_step_tokens > limits.max_step_tokens:
        raise OutOfBounds(f"a warm-up for {warm.max_rows} rows of {warm.max_step_tokens} tokens "
                          f"(this rank serves {limits.max_rows} of {limits.max_step_tokens})")


def _check_pool_size(size: PoolSize, limits: Limits) -> None:
    if limits.num_blocks:
        raise OutOfBounds("a second pool size")
    if size.kind != limits.engine:
        raise OutOfBounds(f"a {size.kind} engine (this rank's is {limits.engine})")
    if size.block_tokens != limits.block_tokens:
        raise OutOfBounds(f"blocks of {size.block_tokens} tokens (this rank's are "
                          f"{limits.block_tokens})")
    if size.nbytes > limits.pool_bytes:
        raise OutOfBounds(f"a KV pool of {size.nbytes} bytes (the ranks' free memory holds "
                          f"{limits.pool_bytes})")


_CHECKS = {Step: _check_step, Copy: _check_copy, WarmUp: _check_warm_up,
           PoolSize: _check_pool_size, Stop: lambda stop, limits: None}
