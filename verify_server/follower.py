"""A rank other than 0 of a split server (sled serve --tp N): its engine, led by rank 0's."""
from __future__ import annotations

from verify_server.engines import make_engine
from verify_server.engines.sharded import Channel, PoolSize, follow, receive
from verify_server.ranks import Ranks, abandon
from verify_server.target import Target


def follow_leader(target: Target, ranks: Ranks) -> None:
    """Its engine over its shard of `target`, the same kind and blocks as rank 0's, running
    rank 0's steps until rank 0 stops."""
    channel = Channel(ranks.group)
    ranks.kv_budget(target.device, 0.0)     # rank 0 sizes the pool by every rank's memory
    size = receive(channel)
    if not isinstance(size, PoolSize):
        abandon(f"rank 0 sent a {type(size).__name__} first, not the pool's size")
    engine = make_engine(target.model, kv_budget_bytes=size.nbytes, block_tokens=size.block_tokens,
                         kind=size.kind, sat=target.sat)
    follow(engine, channel)
