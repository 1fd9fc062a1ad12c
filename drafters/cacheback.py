"""Cacheback: drafting from nothing but a cache of what followed what.

An LRU table maps a leader n-gram to the follower n-grams seen right after it, most recent last.
Drafting looks up the context's last `leader` tokens, appends the most recent follower, and goes
on from the draft's own tail until the draft is long enough. Sessions feed the table through
observe(): their prompt and committed tokens before each draft, their whole output at the end.
One drafter serves all of a device's sessions, so what one session wrote drafts for the next.
It is bounded: at most `size` leaders (the least recently used is dropped) with at most `width`
followers each.

Example, leader 2, follower 3: after the context [5, 6, 7, 8, 9, 5, 6] the leader (5, 6) has the
follower (7, 8, 9), so the draft of 4 is 7, 8, 9, then the follower of (8, 9), ...
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from drafters.base import Proposal, tree_proposal
from drafters.capabilities import Capabilities
from sled.wire.sampling import Sampling
from sled.wire.tree import Trie

OPTIONS = {"leader": 2, "follower": 4, "size": 65536, "width": 4}
ANCHOR = 64            # a context is recognised by its first tokens (see CachebackDrafter._feed)
CONTEXTS = 1024        # contexts whose fed length is remembered


class FollowerTable:
    """leader n-gram -> its follower n-grams (most recent last), both LRU-bounded."""

    def __init__(self, size: int, width: int) -> None:
        self.size, self.width = size, width
        self._leaders: OrderedDict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leaders)

    def add(self, leader: tuple[int, ...], follower: tuple[int, ...]) -> None:
        followers = self._leaders.get(leader)
        if followers is None:
            followers = self._leaders[leader] = OrderedDict()
            if len(self._leaders) > self.size:
                self._leaders.popitem(last=False)
        else:
            self._leaders.move_to_end(leader)
        followers[follower] = None
        followers.move_to_end(follower)
        if len(followers) > self.width:
            followers.popitem(last=False)

    def followers(self, leader: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The leader's followers, most recent first (a lookup refreshes the leader)."""
        followers = self._leaders.get(leader)
        if not followers:
            return []
        self._leaders.move_to_end(leader)
        return list(reversed(followers))


class CachebackDrafter:
    tokenizer_fingerprint = None  # drafts in the target's own ids
    # propose() takes tree=N (one branch per recent follower); observe() feeds the table
    capabilities = Capabilities(trees=True, observes=True)

    def __init__(self, leader: int = 2, follower: int = 4, size: int = 65536, width: int = 4) -> None:
        for name, value in (("leader", leader), ("follower", follower), ("size", size), ("width", width)):
            if value < 1:
                raise ValueError(f"cacheback {name} must be at least 1, got {value}")
        self.leader, self.follower = leader, follower
        self.table = FollowerTable(size, width)
        self.name = f"cacheback:leader={leader}:follower={follower}"
        self._fed: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._lock = threading.Lock()

    def propose(self, context: Sequence[int], draft_len: int, sampling: Sampling,
                generator: np.random.Generator | None = None, *, tree: int = 1) -> Proposal:
        """tree=N > 1: up to N of the context's followers each start a branch, every branch
        continued as a chain is, merged where they share a start (sled.wire.tree.Trie). Its candidates
        are deterministic (q one-hot), so a sampling session may send the tree too."""
        tokens = list(context)
        with self._lock:
            if tree > 1:
                return self._tree(tokens, draft_len, tree)
            draft = self._continue(tokens, [], draft_len)
        # Nothing cached: guess the last token repeats (never an empty draft), as prompt lookup does.
        return Proposal((draft or [tokens[-1]] * draft_len)[:draft_len])  # q = one-hot

    def _continue(self, tokens: list[int], draft: list[int], draft_len: int) -> list[int]:
        """draft, extended by the most recent follower of its own tail until draft_len long (or
        nothing follows)."""
        while len(draft) < draft_len:
            found = self.table.followers(tuple((tokens + draft)[-self.leader:]))
            if not found:
                break
            draft = draft + list(found[0])
        return draft[:draft_len]

    def _tree(self, tokens: list[int], draft_len: int, width: int) -> Proposal:
        trie = Trie()
        for follower in self.table.followers(tuple(tokens[-self.leader:]))[:width]:
            trie.add(self._continue(tokens, list(follower), draft_len))
        if not trie:
            return Proposal([tokens[-1]] * draft_len)
        return tree_proposal(trie.tokens, trie.parents)

    def rollback(self, length: int) -> None:
        """The table holds committed tokens only: nothing to roll back."""

    def observe(self, context: Sequence[int]) -> None:
        """Add the (leader, follower) pairs of committed `context` not added before. A context is
        known by its first ANCHOR tokens and the length fed last time; a context that is not
        (new, or shorter than last time) is fed whole."""
        tokens = list(context)
        with self._lock:
            self._feed(tokens)

    def _feed(self, tokens: list[int]) -> None:
        anchor = tuple(tokens[:ANCHOR])
        fed = self._fed.pop(anchor, 0)
        start = fed if fed <= len(tokens) else 0
        first = max(self.leader, start - self.follower + 1)   # pairs whose follower just filled
        for end in range(first, len(tokens) - self.follower + 1):
            self.table.add(tuple(tokens[end - self.leader:end]), tuple(tokens[end:end + self.follower]))
        self._fed[anchor] = len(tokens)
        if len(self._fed) > CONTEXTS:
            self._fed.popitem(last=False)


def parse_options(arg: str) -> dict[str, int]:
    """"leader=3:width=8" -> {"leader": 3, "width": 8}; a bad one is a ValueError naming it."""
    options: dict[str, int] = {}
    for part in filter(None, arg.split(":")):
        name, _, value = part.partition("=")
        if name not in OPTIONS or not value.isdigit():
            raise ValueError(f"bad cacheback option {part!r}: use NAME=N with NAME one of "
                             f"{', '.join(OPTIONS)} (defaults {OPTIONS})")
        options[name] = int(value)
    return options
