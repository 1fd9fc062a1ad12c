"""A server split over N ranks (sled serve --tp N): rank 0 leads, the other ranks follow.

Every rank holds its shard of the target (transformers' tensor-parallel plan: each layer's heads
and MLP columns split, an all-reduce after the attention and the MLP) and its own engine over a
pool of its KV heads. The pools have the same blocks on every rank; only rank 0 allocates them.
Rank 0 keeps gRPC, the sessions, the scheduler and acceptance; before each forward it tells the
other ranks the step, so that all of them run the same forward together, each on its heads:

    rank 0:  plan rows -> Step(rows as RowPlans) -> forward -> decide -> keep (Copy for a tree)
    rank k:              Step -> the same rows on its pool -> forward (its logits are dropped)

The messages go over a gloo group of their own (CPU tensors, whatever the model's backend), in
the order rank 0 sends them: the engine thread sends every one of them. A step, copy or warm-up
that fails on any rank once the ranks began it ends that rank's process (ranks.abandon): the
others would wait for it in a collective that never completes.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify_server.engines.base import Engine, StepLogits
from verify_server.engines.blocks import BlockPool
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.ranks import abandon

log = logging.getLogger("sled.server.ranks")


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


class Channel:
    """Rank 0's messages to the other ranks, broadcast over `group` (gloo)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def copy(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """BlockPool.followers: every copy rank 0's pool makes, made on every rank."""
        self.send(Copy(tuple(source.tolist()), tuple(dest.tolist())))


class LeadingEngine:
    """Rank 0's engine (every other attribute is `engine`'s own): each forward and warm-up told
    to the other ranks first, and every KV copy of its pool."""

    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine, self.channel = engine, channel
        channel.send(PoolSize(engine.kind, engine.pool.nbytes, engine.pool.block_tokens))
        engine.pool.followers = channel

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def forward(self, rows: Sequence[Row]) -> StepLogits:
        plans = tuple(RowPlan.of(row) for row in rows)
        try:
            self.channel.send(Step(plans))
            return self.engine.forward(rows)
        except Exception as exc:
            abandon(f"a step failed ({type(exc).__name__}: {exc})")

    def warm_up(self, max_rows: int, max_step_tokens: int) -> None:
        try:
            self.channel.send(WarmUp(max_rows, max_step_tokens))
            self.engine.warm_up(max_rows, max_step_tokens)
        except Exception as exc:
            abandon(f"the warm-up failed ({type(exc).__name__}: {exc})")

    def close(self) -> None:
        """The other ranks stop (once; a rank already gone is past telling)."""
        if self.engine.pool.followers is not None:
            self.engine.pool.followers = None
            try:
                self.channel.send(Stop())
            except Exception as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)


def follow(engine: Engine, channel: Channel) -> None:
    """A following rank: run what rank 0 says until it says Stop (or is gone)."""
    while True:
        try:
            message = channel.receive()
        except Exception as exc:
            abandon(f"rank 0 is gone ({type(exc).__name__}: {exc})")
        if isinstance(message, Stop):
            return
        try:
            if isinstance(message, Step):
                engine.forward([plan.row(engine.pool) for plan in message.rows])
            elif isinstance(message, Copy):
                engine.pool.copy(torch.tensor(message.source), torch.tensor(message.dest))
            elif isinstance(message, WarmUp):
                engine.warm_up(message.max_rows, message.max_step_tokens)
            else:
                raise TypeError(f"unknown message {type(message).__name__}")
        except Exception as exc:
            log.exception("a %s failed", type(message).__name__)
            abandon(f"a {type(message).__name__} failed ({type(exc).__name__}: {exc})")
