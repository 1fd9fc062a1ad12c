"""The KV block pool: every session's keys and values live in one preallocated tensor per layer.

The pool is cut into blocks of `block_tokens` slots. A session owns a list of block ids (its
block table); token t of the session sits in slot `table[t // block_tokens] * block_tokens +
t % block_tokens`. Nothing is allocated or copied per step: a forward writes the new tokens'
keys/values into their slots and attention reads the session's slots.

Freed blocks are reused hot first: the last freed block that holds no published prefix goes
next, so a CPU pool's pages (allocated untouched, faulted in on first write) stay as few as the
peak of blocks in use plus the published ones. A published block is reused only when no other
free block is left, least recently freed first; before that, a later prompt can still find it.

Admission works on reservations: a session reserves the blocks its longest possible context needs
when it opens, so a running session never finds the pool full. Full prompt blocks are published
under a hash of the whole prefix they end, keyed by the session's tenant (verify_server.tenant),
so a later session of the same tenant with the same prefix shares them (reference counted); a
shared block is never written again. Another tenant's hashes of the same prefix differ, so it
never finds them, and learns nothing from a hit about what others sent.

    block_tokens = 4, prompt "a b c d e f g" -> table [7, 2]: slots 28..31 hold a b c d,
    slots 8..10 hold e f g. A second prompt "a b c d x" finds block 7 by its prefix hash and
    gets table [7, 5].

A model with sliding-window layers (Gemma 3: five of every six) needs only the last `window`
tokens' KV in them. Its layers are cut into layer groups of equal size, one kind of layer each
(`layer_groups`), and a block holds one group's keys and values of `block_tokens` tokens: a
session keeps a block table per group, its full groups' tables growing with its context, a
windowed group's dropping the blocks that fell out of every later query's window (to the zero
block, 0). All groups draw blocks from the one allocator, so memory goes wherever the sessions
need it. Per layer the pool keeps a tensor per place in a group; the layers at the same place of
different groups share it, each reading and writing only its own group's blocks.

    Gemma 3 270M: 18 layers, 3 full and 15 with a 512-token window -> 6 groups of 3 layers;
    a session at 8,192 tokens holds 512 blocks of the full group and about 33 + a row's worth
    in each windowed group, not 6 x 512
"""
from __future__ import annotations

import functools
import hashlib
import math
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers whose KV a session keeps alike, and how much of it: their sliding window (None:
    every token)."""
    window: int | None
    layers: tuple[int, ...]


@functools.lru_cache(maxsize=None)
def layer_groups(windows: tuple[int | None, ...]) -> tuple[LayerGroup, ...]:
    """Each layer's window -> groups of equal size, one kind of layer each, full layers first:
    as many layers a group as the rarest kind has (a last group of a kind may have fewer)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in sorted(enumerate(windows), key=lambda lw: lw[1] is not None):
        kinds.setdefault(window, []).append(layer)
    if not kinds:
        return (LayerGroup(None, ()),)
    size = min(len(layers) for layers in kinds.values())
    return tuple(LayerGroup(window, tuple(layers[i:i + size]))
                 for window, layers in kinds.items() for i in range(0, len(layers), size))


@dataclass(frozen=True, slots=True)
class KVShape:
    """The model's KV of one token. A model split over `shards` ranks (sled serve --tp N) keeps
    kv_heads / shards heads on each rank: a rank's pool holds `local_kv_heads`, while every
    count in bytes (bytes_per_token, the pool's nbytes) is the whole server's."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    shards: int = 1
    windows: tuple[int | None, ...] = ()   # each layer's sliding window kept; (): every token

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.shards

    @property
    def bytes_per_token(self) -> int:
        """One token's keys and values in every layer."""
        return self.layers * self.layer_bytes

    @property
    def layer_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return layer_groups(self.windows or (None,) * self.layers)

    @property
    def group_layers(self) -> int:
        """Layers in a group: the tensors the pool keeps (one per place in a group)."""
        return max(len(group.layers) for group in self.groups)

    @property
    def slot_bytes(self) -> int:
        """One slot of the pool: a token's keys and values in one group's layers."""
        return self.group_layers * self.layer_bytes

    @classmethod
    def of(cls, model: torch.nn.Module, windowed: bool = True) -> "KVShape":
        """The shape of `model`'s KV; split as the model is (transformers' tp_size);
        `windowed`: its sliding-window layers keep only their window (a split model keeps
        every token: its ranks are told one block table a row)."""
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        shards = getattr(model, "tp_size", None) or 1
        windows = layer_windows(config) if windowed and shards == 1 else ()
        return cls(config.num_hidden_layers, kv_heads, head_dim, next(model.parameters()).dtype,
                   shards, windows)


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention); () for a model without windows."""
    types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
    if not types or not window or "sliding_attention" not in types:
        return ()
    return tuple(window if kind == "sliding_attention" else None
                 for kind in types[:config.num_hidden_layers])


class PoolExhausted(Exception):
    """The pool cannot reserve what a new session needs."""


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on a CPU in an anonymous mapping of its own, whose pages the kernel gives
    zero and faults in on first touch, so an unused pool costs no resident memory. (calloc does
    so only while malloc still maps large blocks itself: a long-lived process may be handed
    recycled heap memory, cleared page by page.)"""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or not nbytes:
        return torch.zeros(*shape, dtype=dtype, device=device)
    pages = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)   # the array keeps the map
    return torch.from_numpy(pages).view(dtype).view(*shape)


def prefix_hashes(tokens: Sequence[int], block_tokens: int, tenant: bytes) -> list[bytes]:
    """One digest per full block of `tokens`, each covering the whole prefix up to its end. The
    chain's root is the tenant key (the hash's key): only the same tenant gets the same digests."""
    digests, running = [], hashlib.blake2b(digest_size=16, key=tenant)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        running.update(b"".join(t.to_bytes(4, "little") for t in tokens[start:start + block_tokens]))
        digests.append(running.copy().digest())
    return digests


def write_kv(pool_keys: torch.Tensor, pool_values: torch.Tensor, slots: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> None:
    """keys/values [tokens, kv_heads, head_dim] into one layer's pool tensors at `slots`
    [tokens], in place (tensors alone: what a compiled layer function runs)."""
    pool_keys.index_copy_(0, slots, keys.to(pool_keys.dtype))
    pool_values.index_copy_(0, slots, values.to(pool_values.dtype))


class BlockPool:
    """`row_tokens`: the most entries a step gives one row (the server's max_step_tokens); it
    bounds the blocks a windowed group's table holds at once. None: windowed groups are
    reserved as full ones."""

    def __init__(self, shape: KVShape, num_blocks: int, block_tokens: int = 16,
                 device: torch.device | str = "cpu", row_tokens: int | None = None) -> None:
        if num_blocks < 2 or block_tokens < 1:
            raise ValueError("the KV pool needs at least two blocks of at least one token")
        self.shape = shape
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.row_tokens = row_tokens
        self.groups = shape.groups
        self.group_of = [0] * shape.layers          # layer -> its group's index
        place = [0] * shape.layers                  # layer -> its place in its group
        for g, group in enumerate(self.groups):
            for i, layer in enumerate(group.layers):
                self.group_of[layer], place[layer] = g, i
        slots = num_blocks * block_tokens
        # Per place in a group: keys and values [slots, kv_heads, head_dim], every slot zero
        # (block 0 is the block padding reads, never given to a session; the flex engine reads
        # a row's last block whole, its unwritten slots masked, and a masked 0 times a NaN is
        # NaN). Per layer, its place's tensors (without windows: a tensor per layer).
        keys = [zeros((slots, shape.local_kv_heads, shape.head_dim), shape.dtype, device)
                for _ in range(shape.group_layers if shape.layers else 0)]
        values = [zeros(k.shape, shape.dtype, device) for k in keys]
        self.keys = [keys[place[layer]] for layer in range(shape.layers)]
        self.values = [values[place[layer]] for layer in range(shape.layers)]
        self.refs = [0] * num_blocks
        # Free blocks without a published prefix, popped from the end: the last freed first
        # (its pages are resident), never used ones (untouched pages) only after them.
        self._spare: list[int] = list(range(num_blocks - 1, 0, -1))
        self._free: OrderedDict[int, None] = OrderedDict()   # free published blocks, oldest first
        self._cached: dict[bytes, int] = {}       # prefix digest -> block
        self._digest: dict[int, bytes] = {}       # block -> its prefix digest
        self.outstanding = 0                      # reserved blocks not allocated yet
        self.bytes_written = 0                    # KV bytes written into the pool, ever
        self.held_tokens = 0                      # sessions' committed tokens (shared blocks count for each)
        self.followers = None     # a split server's other ranks (engines.sharded): told every copy

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_tokens

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_tokens * self.shape.slot_bytes

    @property
    def windowed(self) -> bool:
        return any(group.window is not None for group in self.groups)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - len(self._free) - len(self._spare)

    @property
    def committed_blocks(self) -> int:
        """Blocks in use plus blocks promised to running sessions."""
        return self.used_blocks + self.outstanding

    def blocks_for(self, tokens: int) -> int:
        """Blocks a session of up to `tokens` tokens holds at most, its groups' together."""
        return sum(self.group_blocks(g, tokens) for g in range(len(self.groups)))

    def group_blocks(self, g: int, tokens: int) -> int:
        """Blocks group g of a session of up to `tokens` tokens holds at once: all of them, or
        a windowed group's window and the widest row after it (with a block at either end)."""
        blocks, window = -(-tokens // self.block_tokens), self.groups[g].window
        if window is None or self.row_tokens is None:
            return blocks
        return min(blocks, self.blocks_for_window(window, self.row_tokens))

    def blocks_for_window(self, window: int, row_tokens: int) -> int:
        """The most blocks a windowed group holds at once for rows of up to `row_tokens`: its
        window before the row, the row, and a partial block at either end."""
        return -(-(window + row_tokens) // self.block_tokens) + 2

    # --- reservations --------------------------------------------------------------------------

    def reserve(self, blocks: int) -> None:
        if self.committed_blocks + blocks > self.usable_blocks:
            raise PoolExhausted(blocks)
        self.outstanding += blocks

    def unreserve(self, blocks: int) -> None:
        self.outstanding -= blocks

    # --- blocks ----------------------------------------------------------------------------------

    def allocate(self) -> int:
        """A fresh block against an existing reservation: the last freed unpublished one, else
        the least recently freed published one (its prefix is then no longer found)."""
        block = self._spare.pop() if self._spare else self._free.popitem(last=False)[0]
        digest = self._digest.pop(block, None)
        if digest is not None:
            del self._cached[digest]
        self.refs[block] = 1
        self.outstanding -= 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._park(block)

    def _park(self, block: int) -> None:
        """A block nobody holds: published, it stays findable until reused; else it goes next."""
        if block in self._digest:
            self._free[block] = None
        else:
            self._spare.append(block)

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The longest run of published blocks matching `digests`; each gains a reference."""
        return self.take(digests[:self.found(digests)])

    def found(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, are published (no reference taken)."""
        for count, digest in enumerate(digests):
            if digest not in self._cached:
                return count
        return len(digests)

    def published(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether each of `digests` is published (no reference taken)."""
        return [digest in self._cached for digest in digests]

    def take(self, digests: Sequence[bytes]) -> list[int]:
        """The published blocks of `digests` (each one published); each gains a reference."""
        blocks = []
        for digest in digests:
            block = self._cached[digest]
            if self.refs[block] == 0:
                del self._free[block]
            self.refs[block] += 1
            blocks.append(block)
        return blocks

    def publish(self, block: int, digest: bytes) -> None:
        """Make a full block findable by the prefix digest it ends (first publisher wins)."""
        if digest not in self._cached and block not in self._digest:
            self._cached[digest] = block
            self._digest[block] = digest

    def cached_blocks(self) -> int:
        return len(self._cached)

    # --- data --------------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [tokens, local_kv_heads, head_dim] into `slots` [tokens]."""
        write_kv(self.keys[layer], self.values[layer], slots, keys, values)
        self.count_written(slots.shape[0])

    def count_written(self, tokens: int) -> None:
        """One layer's keys and values of `tokens` written (sled's layer functions write them
        themselves: `write_kv`)."""
        if not torch.compiler.is_compiling():   # a compiled step would guard on the count
            self.bytes_written += 2 * tokens * self.keys[0][0].nbytes

    def copy(self, source: torch.Tensor, dest: torch.Tensor, group: int = 0) -> None:
        """Group `group`'s layers' keys and values at slots `source` [n] written to slots
        `dest` [n] (read whole before any is written, so the two may overlap). Without windows
        the one group is every layer."""
        if self.followers is not None:
            self.followers.copy(source, dest)
        source, dest = source.to(self.keys[0].device), dest.to(self.keys[0].device)
        for layer in self.groups[group].layers:
            self.write(layer, dest, *self.read(layer, source))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered keys/values at `slots` (any shape S): [*S, kv_heads, head_dim] each."""
        return self.keys[layer][slots], self.values[layer][slots]
