"""A rank other than 0 of a split server (sled serve --tp N): its engine, led by rank 0's."""
from __future__ import annotations

import torch

from verify_server.engines import auto_kind, make_engine
from verify_server.engines.sharded import Channel, PoolSize, follow, receive
from verify_server.engines.step_checks import Limits
from verify_server.ranks import Ranks, abandon
from verify_server.target import Target


def follow_leader(target: Target, ranks: Ranks, *, max_rows: int, max_step_tokens: int,
                  block_tokens: int, engine: str = "auto", flex_splits: str = "torch") -> None:
    """Its engine over its shard of `target`, the same kind and blocks as rank 0's, running
    rank 0's steps until rank 0 stops. The rest is this rank's own settings, which bound what
    it takes from rank 0 (step_checks): `max_rows` and `max_step_tokens` a step, the pool's
    `block_tokens` and `engine` kind; `flex_splits`, as rank 0's, from the same settings."""
    channel = Channel(ranks.group)
    limits = Limits(max_rows, max_step_tokens, block_tokens, _engine_kind(engine, target),
                    target.vocab_size, target.sat_slots,
                    # rank 0 sizes the pool by every rank's memory: at most all that is free
                    pool_bytes=ranks.kv_budget(target.device, 1.0))
    size = receive(channel, limits)
    if not isinstance(size, PoolSize):
        abandon(f"rank 0 sent a {type(size).__name__} first, not the pool's size")
    try:
        made = make_engine(target.model, kv_budget_bytes=size.nbytes,
                           block_tokens=size.block_tokens, kind=size.kind, sat=target.sat,
                           flex_splits=flex_splits)
    except Exception as exc:
        abandon(f"the KV pool rank 0 sized could not be made here ({type(exc).__name__}: {exc})")
    follow(made, channel, limits.with_pool(made.pool))


def _engine_kind(engine: str, target: Target) -> str:
    """The kind make_engine makes of `engine` on this rank (as on rank 0: the same settings)."""
    return auto_kind(target.model, torch.device(target.device)) if engine == "auto" else engine
