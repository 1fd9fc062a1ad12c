"""A row: one session's new entries in a step, the unit every engine packs.

    rows:  a (past 3, new 2)   b (past 1, new 3)
    packed input ids:  a a b b b      positions:  3 4 1 2 3

Which entries a row's entries attend to, and at which positions, is `visibility`'s to say.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verify_server.engines.kv import SessionKV


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


def sat_inputs(rows: Sequence[Row]) -> list[tuple[int, int]]:
    """(packed index, slot number) of every SAT slot of a step's rows, packed as the engines
    pack them: each row's tokens, then its SAT blocks."""
    at, offset = [], 0
    for row in rows:
        n = len(row.tokens)
        at.extend((offset + i, (i - n) % row.sat_slots) for i in range(n, row.width))
        offset += row.width
    return at
