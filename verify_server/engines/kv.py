"""One session's view of the KV pool: its block table, its length and its reservation."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from verify_server.engines.blocks import BlockPool, prefix_hashes


class SessionKV:
    """The KV of the tokens the target has seen for one session.

    `length` counts the committed tokens; the last committed token is not among them, it is fed
    again with the next draft. A forward writes a row's new tokens into the slots after `length`
    without changing it; `commit(n)` then keeps the first n of them, and the rest are overwritten
    by the next forward, so rolling back costs nothing. `commit` is the only way `length` grows.

        length 5; a round feeds [t, d1, d2, d3] into slots 5..8; d1 is accepted, d2 rejected
        -> commit(2): length 7 (t and d1 stay; the correction goes in with the next draft)
    """

    __slots__ = ("pool", "table", "_length", "reserved", "shared", "tenant", "_slot_ids")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.table: list[int] = []
        self._length = 0
        self.reserved = 0     # blocks promised by the pool, not yet in the table
        self.shared = 0       # leading blocks found in the prefix cache
        self.tenant = b""     # whose prefix blocks it may share (verify_server.tenant)
        self._slot_ids = torch.empty(0, dtype=torch.long)   # slot of every position the table covers

    @classmethod
    def mirror(cls, pool: BlockPool, table: Sequence[int], length: int) -> "SessionKV":
        """Another rank's copy of a session's KV (engines.sharded): its block table and length
        as the serving rank holds them, nothing reserved (that rank allocates)."""
        kv = cls(pool)
        kv.table, kv._length = list(table), length
        bt = pool.block_tokens
        blocks = torch.tensor(kv.table, dtype=torch.long)
        kv._slot_ids = (blocks[:, None] * bt + torch.arange(bt)).flatten()
        return kv

    @property
    def length(self) -> int:
        return self._length

    def admit(self, prefill: Sequence[int], max_tokens: int, tenant: bytes) -> int:
        """Take cached prefix blocks of `prefill` that `tenant` published and reserve the rest of
        `max_tokens`; what this session publishes later is found by the same tenant only.

        Returns the number of prefill tokens already in the cache. Raises PoolExhausted (and
        holds nothing) when the pool cannot promise the rest.
        """
        found = self.pool.lookup(prefix_hashes(prefill, self.pool.block_tokens, tenant))
        need = max(self.pool.blocks_for(max_tokens) - len(found), 0)
        try:
            self.pool.reserve(need)
        except Exception:
            self.pool.release(found)
            raise
        self.table, self.shared, self.reserved, self.tenant = [], len(found), need, tenant
        for block in found:
            self._extend(block)
        self._set_length(len(found) * self.pool.block_tokens)
        return self._length

    def commit(self, tokens: int) -> None:
        """Keep the first `tokens` of those the last forward wrote after `length`."""
        if self._length + tokens > len(self._slot_ids):
            raise RuntimeError(f"commit of {tokens} tokens at length {self._length} passes the "
                               f"{len(self._slot_ids)} slots the forward wrote")
        self._set_length(self._length + tokens)

    def keep_path(self, path: Sequence[int]) -> None:
        """After a tree draft's forward: move the KV of its accepted nodes (`path`: offsets after
        `length`, root's child first) to the slots right after the root, where `commit` keeps
        them. A chain's path (1, 2, ...) is where it is already.

            length 5; the forward wrote root, a, b, c, d into slots 5..9; path (3, 4)
            -> c and d move to slots 6 and 7; commit(3) keeps root, c, d
        """
        moves = [(self._length + node, self._length + i) for i, node in enumerate(path, start=1)
                 if node != i]
        if moves:
            source, dest = zip(*moves)
            self.pool.copy(self._slot_ids[list(source)], self._slot_ids[list(dest)])

    def _set_length(self, length: int) -> None:
        self.pool.held_tokens += length - self._length
        self._length = length

    def publish(self, tokens: Sequence[int]) -> None:
        """Offer this session's full blocks of `tokens` (its committed prefix) for sharing."""
        digests = prefix_hashes(tokens[: self._length], self.pool.block_tokens, self.tenant)
        for block, digest in zip(self.table[self.shared:len(digests)], digests[self.shared:]):
            self.pool.publish(block, digest)

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot ids of positions [start, end) (a view), growing the table as needed."""
        while len(self.table) * self.pool.block_tokens < end:
            if self.reserved <= 0:
                raise RuntimeError("session grew past its KV reservation")
            self._extend(self.pool.allocate())
            self.reserved -= 1
        return self._slot_ids[start:end]

    def _extend(self, block: int) -> None:
        bt = self.pool.block_tokens
        self.table.append(block)
        self._slot_ids = torch.cat([self._slot_ids, torch.arange(block * bt, (block + 1) * bt)])

    def free(self) -> None:
        self.pool.release(self.table)
        self.pool.unreserve(self.reserved)
        self._set_length(0)
        self.table, self.reserved, self.shared, self.tenant = [], 0, 0, b""
        self._slot_ids = torch.empty(0, dtype=torch.long)
