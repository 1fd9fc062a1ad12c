"""Rank 0's messages to the other ranks of a split server (engines.sharded), and their wire:
int64 tensors of a fixed layout, never pickles. A message is a header, then its payload:

    header   [LAYOUT, kind, n]          kind: an index into KINDS; n: the payload's length
    payload  n int64 values, by kind:
      Step      rows, then per row: len(table), length, len(tokens), want_logits, sat_slots,
                len(sat_anchors), len(parents), then table, tokens, sat_anchors, parents
      Copy      source, then dest (as long as source)
      WarmUp    max_rows, max_step_tokens
      PoolSize  engine kind (an index into engines.ENGINES), nbytes, block_tokens
      Stop      (nothing)

    Copy((4, 5), (9, 10))  ->  header [LAYOUT, 1, 4], payload [4, 5, 9, 10]

Every value of every message is a count, a length, an index or a token id: none is negative.
A receiver reads only what the layout says, checked at every step (`Unreadable` otherwise:
a header of another layout or kind, a payload longer than its own limits allow a message of
that kind, or one of the wrong shape); whether it can act on what it read is step_checks'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from verify_server.engines.base import ENGINES
from verify_server.engines.blocks import BlockPool
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row

LAYOUT = 0x736C6564_0001      # "sled", layout 1: both ends must speak the same
HEADER = 3                    # int64 values
ROW_FIELDS = 7                # a row's values before its sequences


class PayloadLimits(Protocol):
    """What a receiver allows a message of each kind (step_checks.Limits)."""

    def max_values(self, kind: type) -> int: ...


class Unreadable(ValueError):
    """A message that is not one of rank 0's: nothing of it is acted on."""


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A row as another rank needs it: its session's block table and length, and its entries."""
    table: tuple[int, ...]
    length: int
    tokens: tuple[int, ...]
    want_logits: bool
    sat_slots: int
    sat_anchors: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def of(cls, row: Row) -> "RowPlan":
        """The plan of `row`, its blocks allocated first (the forward would allocate them)."""
        kv = row.kv
        kv.slots(kv.length, kv.length + row.width)
        return cls(tuple(kv.table), kv.length, tuple(row.tokens), row.want_logits, row.sat_slots,
                   tuple(row.sat_anchors), tuple(row.parents))

    def row(self, pool: BlockPool) -> Row:
        """The same row over this rank's pool."""
        return Row(SessionKV.mirror(pool, self.table, self.length), list(self.tokens),
                   self.want_logits, self.sat_slots, self.sat_anchors, self.parents)


@dataclass(frozen=True, slots=True)
class Step:
    rows: tuple[RowPlan, ...]


@dataclass(frozen=True, slots=True)
class Copy:
    """BlockPool.copy: a tree's accepted path moved to the slots after its root."""
    source: tuple[int, ...]
    dest: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WarmUp:
    max_rows: int
    max_step_tokens: int


@dataclass(frozen=True, slots=True)
class PoolSize:
    """The first message: the engine every rank builds, and its pool's bytes (the whole
    server's: the same blocks on every rank)."""
    kind: str
    nbytes: int
    block_tokens: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


KINDS = (Step, Copy, WarmUp, PoolSize, Stop)


def encode(message) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload of `message` (int64 CPU tensors)."""
    kind = KINDS.index(type(message))
    values = _ENCODERS[kind](message)
    if min(values, default=0) < 0:
        raise ValueError(f"a {type(message).__name__} the layout cannot carry")
    return (torch.tensor([LAYOUT, kind, len(values)], dtype=torch.int64),
            torch.tensor(values, dtype=torch.int64))


def payload_length(header: torch.Tensor, limits: PayloadLimits) -> int:
    """The length of the payload `header` announces, once it is known to be rank 0's and
    within what the receiver's own `limits` allow its kind."""
    kind, n = _announced(header)
    most = limits.max_values(KINDS[kind])
    if not 0 <= n <= most:
        raise Unreadable(f"a payload of {n} values (a {KINDS[kind].__name__} here has at most "
                         f"{most})")
    return n


def _announced(header: torch.Tensor) -> tuple[int, int]:
    """The kind and payload length of a header of this layout."""
    if header.dtype != torch.int64 or header.shape != (HEADER,):
        raise Unreadable(f"a header of {header.dtype} {tuple(header.shape)}, not int64 ({HEADER},)")
    layout, kind, n = header.tolist()
    if layout != LAYOUT:
        raise Unreadable(f"a header of another layout ({layout:#x}, not {LAYOUT:#x})")
    if not 0 <= kind < len(KINDS):
        raise Unreadable(f"a message of unknown kind {kind}")
    return kind, n


def decode(header: torch.Tensor, payload: torch.Tensor):
    """The message of `header` and `payload`; Unreadable unless they are exactly one."""
    kind, n = _announced(header)
    if payload.dtype != torch.int64 or payload.shape != (n,):
        raise Unreadable(f"a payload of {payload.dtype} {tuple(payload.shape)}, not int64 ({n},)")
    if n and int(payload.min()) < 0:
        raise Unreadable("a negative value in the payload")
    fields = _Fields(payload.numpy())
    message = _DECODERS[kind](fields)
    fields.done()
    return message


class _Fields:
    """A payload read front to back, each field made Python ints only as it is read (no list
    of the whole payload); Unreadable past its end or short of it."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.at = values, 0

    def take(self, n: int) -> tuple[int, ...]:
        if n > len(self.values) - self.at:
            raise Unreadable(f"the payload ends early: {n - len(self.values) + self.at} more "
                             "values wanted")
        self.at += n
        return tuple(self.values[self.at - n:self.at].tolist())

    def one(self) -> int:
        return self.take(1)[0]

    def flag(self) -> bool:
        value = self.one()
        if value not in (0, 1):
            raise Unreadable(f"a flag of {value}")
        return bool(value)

    def done(self) -> None:
        if self.at != len(self.values):
            raise Unreadable(f"values past the message's end: {len(self.values) - self.at}")


def _encode_step(step: Step) -> list[int]:
    values = [len(step.rows)]
    for plan in step.rows:
        values += [len(plan.table), plan.length, len(plan.tokens), int(plan.want_logits),
                   plan.sat_slots, len(plan.sat_anchors), len(plan.parents),
                   *plan.table, *plan.tokens, *plan.sat_anchors, *plan.parents]
    return values


def _decode_step(fields: _Fields) -> Step:
    rows = fields.one()
    return Step(tuple(_decode_row(fields) for _ in range(rows)))


def _decode_row(fields: _Fields) -> RowPlan:
    tables, length, tokens, want_logits = fields.one(), fields.one(), fields.one(), fields.flag()
    sat_slots, anchors, parents = fields.one(), fields.one(), fields.one()
    return RowPlan(fields.take(tables), length, fields.take(tokens), want_logits, sat_slots,
                   fields.take(anchors), fields.take(parents))


def _decode_copy(fields: _Fields) -> Copy:
    half, odd = divmod(len(fields.values), 2)
    if odd:
        raise Unreadable(f"a Copy of {len(fields.values)} values: not a source and a dest")
    return Copy(fields.take(half), fields.take(half))


def _encode_copy(copy: Copy) -> list[int]:
    if len(copy.source) != len(copy.dest):
        raise ValueError(f"a Copy of {len(copy.source)} slots to {len(copy.dest)}")
    return [*copy.source, *copy.dest]


def _encode_pool_size(size: PoolSize) -> list[int]:
    if size.kind not in ENGINES:
        raise ValueError(f"a PoolSize of engine kind {size.kind!r}: not one of {ENGINES}")
    return [ENGINES.index(size.kind), size.nbytes, size.block_tokens]


def _decode_pool_size(fields: _Fields) -> PoolSize:
    kind, nbytes, block_tokens = fields.take(3)
    if kind >= len(ENGINES):
        raise Unreadable(f"an engine kind of {kind} (there are {len(ENGINES)})")
    return PoolSize(ENGINES[kind], nbytes, block_tokens)


_ENCODERS = (
    _encode_step,
    _encode_copy,
    lambda warm: [warm.max_rows, warm.max_step_tokens],
    _encode_pool_size,
    lambda stop: [],
)
_DECODERS = (
    _decode_step,
    _decode_copy,
    lambda fields: WarmUp(*fields.take(2)),
    _decode_pool_size,
    lambda fields: Stop(),
)
