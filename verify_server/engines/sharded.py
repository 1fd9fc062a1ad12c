"""A server split over N ranks (sled serve --tp N): rank 0 leads, the other ranks follow.

Every rank holds its shard of the target (transformers' tensor-parallel plan: each layer's heads
and MLP columns split, an all-reduce after the attention and the MLP) and its own engine over a
pool of its KV heads. The pools have the same blocks on every rank; only rank 0 allocates them.
Rank 0 keeps gRPC, the sessions, the scheduler and acceptance; before each forward it tells the
other ranks the step, so that all of them run the same forward together, each on its heads:

    rank 0:  plan rows -> Step(rows as RowPlans) -> forward -> decide -> keep (Copy for a tree)
    rank k:              Step -> the same rows on its pool -> forward (its logits are dropped)

The messages (step_messages) go over a gloo group of their own as int64 tensors of a fixed
layout (CPU tensors, whatever the model's backend), in the order rank 0 sends them: the engine
thread sends every one of them. A step, copy or warm-up that fails on any rank once the ranks
began it ends that rank's process (ranks.abandon): the others would wait for it in a collective
that never completes. So does a message a following rank cannot read, or one outside its own
limits (step_checks: its settings, target and pool): it acts on none of it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from verify_server.engines.base import Engine, StepLogits
from verify_server.engines.rows import Row
from verify_server.engines.step_checks import Limits, OutOfBounds, check
from verify_server.engines.step_messages import (
    HEADER, Copy, PoolSize, RowPlan, Step, Stop, Unreadable, WarmUp, decode, encode,
    payload_length)
from verify_server.ranks import abandon

log = logging.getLogger("sled.server.ranks")


class Channel:
    """Rank 0's messages to the other ranks, broadcast over `group` (gloo): a header, then the
    payload it announces (step_messages)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, message) -> None:
        header, payload = encode(message)
        dist.broadcast(header, src=0, group=self.group)
        if len(payload):
            dist.broadcast(payload, src=0, group=self.group)

    def receive(self, limits: Limits):
        """Rank 0's next message, within this rank's `limits`; Unreadable for anything else,
        OutOfBounds for a message past them (nothing of either is acted on)."""
        header = torch.zeros(HEADER, dtype=torch.int64)   # a shorter message leaves zeros
        dist.broadcast(header, src=0, group=self.group)
        payload = torch.zeros(payload_length(header, limits), dtype=torch.int64)
        if len(payload):
            dist.broadcast(payload, src=0, group=self.group)
        message = decode(header, payload)
        check(message, limits)
        return message

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
        return self.launch(rows)

    def launch(self, rows: Sequence[Row], send_argmax: bool = False) -> StepLogits:
        """The other ranks run the step in the order rank 0 launches it (an overlapped step's
        KV copies, made at its decision, follow the next step's launch on every rank alike)."""
        plans = tuple(RowPlan.of(row) for row in rows)
        try:
            self.channel.send(Step(plans))
            return self.engine.launch(rows, send_argmax)
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


def receive(channel: Channel, limits: Limits):
    """A following rank's next message from rank 0; one it cannot read, one past its `limits`,
    or a rank 0 gone, ends this rank."""
    try:
        return channel.receive(limits)
    except Unreadable as exc:
        abandon(f"a message from rank 0 could not be read ({exc}); none of it ran")
    except OutOfBounds as exc:
        abandon(f"rank 0 sent what this rank cannot act on ({exc}); none of it ran")
    except Exception as exc:
        abandon(f"rank 0 is gone ({type(exc).__name__}: {exc})")


def follow(engine: Engine, channel: Channel, limits: Limits) -> None:
    """A following rank: run what rank 0 says, each message within `limits` (those of
    `engine`'s pool), until it says Stop (or is gone)."""
    while True:
        message = receive(channel, limits)
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
