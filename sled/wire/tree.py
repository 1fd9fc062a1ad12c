"""Token trees: a draft with several candidates per position, as the wire carries it.

A tree draft is its tokens in an order where every parent comes before its children, and one
parent index per token: 0 is the draft's root (the session's last token, which the server feeds
with every draft), i >= 1 is token_ids[i - 1]. A chain is the tree whose parents are 0, 1, 2, ...

    token_ids  a  b  c  d          parents  0  1  0  3
    root -> a -> b                  (a's child b)
         -> c -> d                  (a sibling of a, then its child d)

The server verifies every node in one pass (each node attends to its ancestors only) and, greedy,
accepts the longest path whose every token is the target's own argmax. Devices build trees by
inserting candidate chains into a `Trie`; both sides check and measure them here.
"""
from __future__ import annotations

from collections.abc import Sequence


def chain_parents(n: int) -> list[int]:
    """The parents of an n-token chain: [0, 1, ..., n - 1]."""
    return list(range(n))


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i for i, parent in enumerate(parents))


def tree_problem(parents: Sequence[int], tokens: int) -> str | None:
    """What makes `parents` no tree over `tokens` draft tokens, in words; None when it is one.
    A parent must come before its child (parents[i] <= i), which also rules out cycles."""
    if len(parents) != tokens:
        return f"{len(parents)} parents for {tokens} draft tokens: send one per token or none"
    for i, parent in enumerate(parents):
        if parent == i + 1:
            return f"parents[{i}] = {parent} makes token {i} its own parent (a cycle)"
        if parent > i:
            return (f"parents[{i}] = {parent} points at a later token: a parent must come "
                    f"before its child (0 = the root, j = token_ids[j - 1], so at most {i})")
    return None


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth below the root (its distance from the root, 1 for the root's
    children): depths([0, 1, 0, 3]) == [1, 2, 1, 2]."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth[1:]


def children(parents: Sequence[int]) -> list[list[int]]:
    """For the root and every token (node 0 = root, node i = token i - 1), its child nodes in order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent].append(i + 1)
    return kids


def cut(tokens: Sequence[int], parents: Sequence[int], max_depth: int,
        max_nodes: int) -> tuple[list[int], list[int]]:
    """The tree without tokens deeper than max_depth, then its first max_nodes tokens (a prefix
    of a valid order is still a tree), parents renumbered: what fits a session's room."""
    kept: dict[int, int] = {0: 0}           # old node -> new node
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for i, (token, parent, depth) in enumerate(zip(tokens, parents, depths(parents))):
        if len(out_tokens) == max_nodes:
            break
        if depth > max_depth or parent not in kept:
            continue
        out_tokens.append(token)
        out_parents.append(kept[parent])
        kept[i + 1] = len(out_tokens)
    return out_tokens, out_parents


class Trie:
    """Candidate chains merged into one tree: chains that share a start share its nodes.

        trie = Trie(); trie.add([5, 6, 7]); trie.add([5, 8])
        trie.tokens == [5, 6, 7, 8]; trie.parents == [0, 1, 2, 1]
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}     # (node, token) -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, chain: Sequence[int], under: int = 0) -> int:
        """Insert `chain` below node `under` (0 = the root); returns the node it ends at."""
        node = under
        for token in chain:
            found = self._child.get((node, token))
            if found is None:
                self.tokens.append(token)
                self.parents.append(node)
                found = self._child[(node, token)] = len(self.tokens)
            node = found
        return node
