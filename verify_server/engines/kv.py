"""One session's view of the KV pool: its block tables, its length and its reservation."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verify_server.engines.blocks import BlockPool, prefix_hashes

DROPPED = 0     # a windowed group's table entry for a block out of every later query's window


class SessionKV:
    """The KV of the tokens the target has seen for one session.

    `length` counts the committed tokens; the last committed token is not among them, it is fed
    again with the next draft. A forward writes a row's new tokens into the slots after `length`
    without changing it; `commit(n)` then keeps the first n of them, and the rest are overwritten
    by the next forward, so rolling back costs nothing. `commit` is the only way `length` grows.

        length 5; a round feeds [t, d1, d2, d3] into slots 5..8; d1 is accepted, d2 rejected
        -> commit(2): length 7 (t and d1 stay; the correction goes in with the next draft)

    The session has a block table per layer group of the pool (`BlockPool.groups`; one without
    sliding windows). A windowed group's table drops a block (to DROPPED: its slots are then
    the zero block's, which no query of the window reads) once every position in it is out of
    the window of every query to come: a query at position >= length sees keys past
    length - window. Its own blocks go back to the pool and the reservation is kept for the
    blocks it still has to take; a shared one is only released.
    """

    __slots__ = ("pool", "tables", "_length", "reserved", "shared", "tenant", "_slot_ids",
                 "_limits", "_caps")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        groups = len(pool.groups)
        self.tables: list[list[int]] = [[] for _ in range(groups)]
        self._length = 0
        self.reserved = [0] * groups     # blocks promised by the pool, not yet in each table
        self.shared = 0       # leading blocks found in the prefix cache (every group's places)
        self.tenant = b""     # whose prefix blocks it may share (verify_server.tenant)
        self._limits = [0] * groups      # the most blocks each table may hold (max_tokens)
        self._caps = [0] * groups        # the most blocks each table holds at once
        # slot of every position each table covers
        self._slot_ids = [torch.empty(0, dtype=torch.long) for _ in range(groups)]

    @classmethod
    def mirror(cls, pool: BlockPool, table: Sequence[int], length: int) -> "SessionKV":
        """Another rank's copy of a session's KV (engines.sharded, whose pools have one group):
        its block table and length as the serving rank holds them, nothing reserved (that rank
        allocates)."""
        kv = cls(pool)
        kv.tables[0], kv._length = list(table), length
        kv._slot_ids[0] = _slots_of(kv.tables[0], pool.block_tokens)
        return kv

    @property
    def table(self) -> list[int]:
        """The first group's table: every layer's, in a pool without windows."""
        return self.tables[0]

    @property
    def length(self) -> int:
        return self._length

    @property
    def reserved_blocks(self) -> int:
        return sum(self.reserved)

    def admit(self, prefill: Sequence[int], max_tokens: int, tenant: bytes) -> int:
        """Take cached prefix blocks of `prefill` that `tenant` published and reserve the rest of
        `max_tokens`; what this session publishes later is found by the same tenant only.

        A prefix counts as cached where every group has the blocks its next query reads: a full
        group all of them, a windowed group those in the window before it.

        Returns the number of prefill tokens already in the cache. Raises PoolExhausted (and
        holds nothing) when the pool cannot promise the rest.
        """
        pool, bt = self.pool, self.pool.block_tokens
        digests = prefix_hashes(prefill, bt, tenant)
        cached = self._cached_prefix([group_digests(digests, g) for g in range(len(pool.groups))])
        found = [pool.take(group_digests(digests, g)[self._first_kept(g, cached * bt):cached])
                 for g in range(len(pool.groups))]
        # a group's table takes totals - cached blocks more; a windowed one holds at most its
        # limit of them at once (the blocks it drops are reserved again while it still grows)
        totals = -(-max_tokens // bt)
        need = [max(min(pool.group_blocks(g, max_tokens), totals - cached), 0)
                for g in range(len(pool.groups))]
        try:
            pool.reserve(sum(need))
        except Exception:
            for blocks in found:
                pool.release(blocks)
            raise
        self.shared, self.reserved, self.tenant = cached, need, tenant
        self._limits = [totals] * len(pool.groups)
        self._caps = [pool.group_blocks(g, max_tokens) for g in range(len(pool.groups))]
        for g, blocks in enumerate(found):
            self.tables[g] = [DROPPED] * (cached - len(blocks)) + blocks
            self._slot_ids[g] = _slots_of(self.tables[g], bt)
        self._set_length(cached * bt)
        return self._length

    def _cached_prefix(self, digests: list[list[bytes]]) -> int:
        """The most leading blocks of the prompt cached in every group as admit needs them."""
        present = [np.array(self.pool.published(ds), dtype=bool) for ds in digests]
        full = [p for p, group in zip(present, self.pool.groups) if group.window is None]
        blocks = min((int(p.argmin()) if not p.all() else len(p) for p in full),
                     default=len(present[0]))      # no longer than every full group's run
        bt = self.pool.block_tokens
        missing = [np.concatenate([[0], np.cumsum(~p)]) for p in present]
        for n in range(blocks, 0, -1):
            if all(missing[g][n] - missing[g][self._first_kept(g, n * bt)] == 0
                   for g in range(len(digests))):
                return n
        return 0

    def _first_kept(self, g: int, length: int) -> int:
        """Group g's first block a query at `length` or later may read."""
        window = self.pool.groups[g].window
        if window is None:
            return 0
        return max(0, (length - window + 1) // self.pool.block_tokens)

    def commit(self, tokens: int) -> None:
        """Keep the first `tokens` of those the last forward wrote after `length`."""
        if self._length + tokens > len(self._slot_ids[0]):
            raise RuntimeError(f"commit of {tokens} tokens at length {self._length} passes the "
                               f"{len(self._slot_ids[0])} slots the forward wrote")
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
            source, dest = (list(places) for places in zip(*moves))
            for g, slot_ids in enumerate(self._slot_ids):
                self.pool.copy(slot_ids[source], slot_ids[dest], g)

    def _set_length(self, length: int) -> None:
        self.pool.held_tokens += length - self._length
        self._length = length

    def publish(self, tokens: Sequence[int]) -> None:
        """Offer this session's full blocks of `tokens` (its committed prefix) for sharing: each
        group's it still holds."""
        digests = prefix_hashes(tokens[: self._length], self.pool.block_tokens, self.tenant)
        for g, table in enumerate(self.tables):
            for block, digest in zip(table[self.shared:len(digests)],
                                     group_digests(digests, g)[self.shared:]):
                if block != DROPPED:
                    self.pool.publish(block, digest)

    def slots(self, start: int, end: int, group: int = 0) -> torch.Tensor:
        """Slot ids of positions [start, end) in group `group` (a view), every table grown to
        `end` as needed (a windowed one first dropping what no query reads any more)."""
        for g in range(len(self.tables)):
            self._grow(g, end)
        return self._slot_ids[group][start:end]

    def _grow(self, g: int, end: int) -> None:
        table, bt = self.tables[g], self.pool.block_tokens
        if len(table) * bt >= end:
            return
        self._drop(g)
        grown = []
        while (len(table) + len(grown)) * bt < end:
            if self.reserved[g] <= 0:
                raise RuntimeError("session grew past its KV reservation")
            grown.append(self.pool.allocate())
            self.reserved[g] -= 1
        table.extend(grown)
        self._slot_ids[g] = torch.cat([self._slot_ids[g], _slots_of(grown, bt)])

    def _drop(self, g: int) -> None:
        """A windowed group's blocks before the first one a query at `length` or later reads
        go back to the pool; each of its own (not shared) leaves its place reserved, while the
        table still has blocks to take."""
        table = self.tables[g]
        first = min(self._first_kept(g, self._length), len(table))
        dropped = [(i, table[i]) for i in range(first) if table[i] != DROPPED]
        if not dropped:
            return
        bt = self.pool.block_tokens
        slot_ids = self._slot_ids[g].clone()     # a new tensor: views handed out stay as they were
        for i, block in dropped:
            table[i] = DROPPED
            slot_ids[i * bt:(i + 1) * bt] = torch.arange(bt)   # the zero block's slots
            self.pool.release([block])
            if self.pool.refs[block] == 0 and self.reserved[g] < self._room(g):
                self.pool.reserve(1)
                self.reserved[g] += 1
        self._slot_ids[g] = slot_ids

    def _room(self, g: int) -> int:
        """Blocks group g's table may still take while holding no more than its cap at once."""
        held = sum(1 for block in self.tables[g] if block != DROPPED)
        return max(min(self._caps[g] - held, self._limits[g] - len(self.tables[g])), 0)

    def narrow(self, row_tokens: int) -> None:
        """From now on no row of this session has more than `row_tokens` entries (its prompt is
        in; drafts are short): each windowed group drops what no query reads any more, its cap
        shrinks to its window and such a row, and what it had reserved past that goes back to
        the pool."""
        for g, group in enumerate(self.pool.groups):
            if group.window is None:
                continue
            cap = self.pool.blocks_for_window(group.window, row_tokens)
            self._caps[g] = min(self._caps[g], cap)
            self._drop(g)
            spare = self.reserved[g] - self._room(g)
            if spare > 0:
                self.reserved[g] -= spare
                self.pool.unreserve(spare)

    def free(self) -> None:
        for table in self.tables:
            self.pool.release([block for block in table if block != DROPPED])
        self.pool.unreserve(self.reserved_blocks)
        self._set_length(0)
        groups = len(self.tables)
        self.tables, self.reserved, self.shared, self.tenant = \
            [[] for _ in range(groups)], [0] * groups, 0, b""
        self._slot_ids = [torch.empty(0, dtype=torch.long) for _ in range(groups)]


def group_digests(digests: list[bytes], g: int) -> list[bytes]:
    """The prefix digests of group g's blocks: the first group's are the prompt's own."""
    if not g:
        return digests
    suffix = g.to_bytes(2, "little")
    return [digest + suffix for digest in digests]


def _slots_of(blocks: Sequence[int], block_tokens: int) -> torch.Tensor:
    blocks = torch.tensor(list(blocks), dtype=torch.long)
    return (blocks[:, None] * block_tokens + torch.arange(block_tokens)).flatten()
