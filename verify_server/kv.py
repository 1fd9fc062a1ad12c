"""One session's view of the KV pool: its block table, its length and its reservation."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from verify_server.blocks import BlockPool, prefix_hashes


class SessionKV:
    """The KV of the tokens the target has seen for one session. `length` excludes the last
    committed token, which is fed again with the next draft. Rolling back is a length change."""

    __slots__ = ("pool", "table", "length", "reserved", "shared", "_slot_ids")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.table: list[int] = []
        self.length = 0
        self.reserved = 0     # blocks promised by the pool, not yet in the table
        self.shared = 0       # leading blocks found in the prefix cache
        self._slot_ids = torch.empty(0, dtype=torch.long)   # slot of every position the table covers

    def admit(self, prefill: Sequence[int], max_tokens: int) -> int:
        """Take cached prefix blocks of `prefill` and reserve the rest of `max_tokens`.

        Returns the number of prefill tokens already in the cache. Raises PoolExhausted (and
        holds nothing) when the pool cannot promise the rest.
        """
        found = self.pool.lookup(prefix_hashes(prefill, self.pool.block_tokens))
        need = max(self.pool.blocks_for(max_tokens) - len(found), 0)
        try:
            self.pool.reserve(need)
        except Exception:
            self.pool.release(found)
            raise
        self.table, self.shared, self.reserved = [], len(found), need
        for block in found:
            self._extend(block)
        self.length = len(found) * self.pool.block_tokens
        return self.length

    def publish(self, tokens: Sequence[int]) -> None:
        """Offer this session's full blocks of `tokens` (its committed prefix) for sharing."""
        digests = prefix_hashes(tokens[: self.length], self.pool.block_tokens)
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

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (rejected draft tokens fall away)."""
        self.length = min(self.length, length)

    def free(self) -> None:
        self.pool.release(self.table)
        self.pool.unreserve(self.reserved)
        self.table, self.reserved, self.length, self.shared = [], 0, 0, 0
        self._slot_ids = torch.empty(0, dtype=torch.long)
