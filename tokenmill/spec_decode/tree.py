"""Token trees for speculative decoding: speculative tokens plus the parent of each.

A request's drafts can form a tree instead of a chain: node i is a guess for the token after its
parent (parents[i], an earlier node, or -1 for the request's last real token, the tree's root). One
forward pass verifies every node: node i is a query row at position root + depth(i) that attends to
the context and to its ancestors only (worker/batch.py builds that mask; the decode attention kernel
applies it). A chain is the tree whose parents are -1, 0, 1, ...; an empty parents list means a chain.

TokenTree is a static tree shape like Medusa's `medusa_choices`: each node a path of candidate ranks,
[0] the first head's top-1, [1] its second choice, [0, 2] the second head's third choice after [0].
Nodes are kept sorted by depth (then by path), so every prefix of the node list is a tree too (the
scheduler may cut the drafts of a step short) and keeping the nodes up to a depth is such a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TREE_NODES = 64  # the attention kernel's ancestor bitmask is one int64 per row


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, path)

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> "TokenTree":
        """A tree from Medusa-style paths, checked: non-empty lists of ranks >= 0, each path's prefixes present."""
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ValueError(f"a speculative tree must be a non-empty list of paths like [[0], [1], [0, 0]], got {paths!r}")
        seen = set()
        for path in paths:
            if (not isinstance(path, (list, tuple)) or not path
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
                raise ValueError(f"each tree path must be a non-empty list of candidate ranks >= 0, got {path!r}")
            if tuple(path) in seen:
                raise ValueError(f"the tree lists path {list(path)} twice")
            seen.add(tuple(path))
        for path in seen:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree path {list(path)} has no parent: add {list(path[:-1])}")
        if len(seen) > MAX_TREE_NODES:
            raise ValueError(f"a speculative tree may have at most {MAX_TREE_NODES} nodes, got {len(seen)}")
        return cls(tuple(sorted(seen, key=lambda p: (len(p), p))))

    @classmethod
    def of_width(cls, depth: int, width: int) -> "TokenTree":
        """The top-1 chain of the given depth, and at every depth the next width - 1 candidates beside it:
        depth * width nodes, where the paths most often kept (those of top-1 guesses) go deepest."""
        return cls.from_paths([[0] * d + [r] for d in range(depth) for r in range(width)])

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def is_chain(self) -> bool:
        return all(p[-1] == 0 for p in self.paths)

    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def num_nodes_within(self, depth: int) -> int:
        """How many nodes (a prefix of the list) lie at most `depth` deep."""
        return sum(len(p) <= depth for p in self.paths)

    def heads_and_ranks(self) -> tuple[np.ndarray, np.ndarray]:
        """For each node, the head that guesses it (depth - 1) and its rank among that head's candidates."""
        return (np.array([len(p) - 1 for p in self.paths], dtype=np.int64), np.array([p[-1] for p in self.paths], dtype=np.int64))


def confident_nodes(node_pass: np.ndarray, node_rank: np.ndarray, probs: np.ndarray, threshold: float) -> np.ndarray:
    """Which nodes of a tree that branches off a top-1 chain to verify (a bool mask): node i is candidate
    node_rank[i] of draft pass node_pass[i]; probs [passes run, width] holds each pass's candidates' draft
    probabilities. A node is kept when its pass ran and the draft's probability of its path (the top-1
    chain's probabilities before its pass, times its own) is at least threshold. A node's path is never
    more probable than its parent's, so the nodes kept form a tree again (for a chain, a prefix of it)."""
    ran = node_pass < len(probs)
    chain_before = np.concatenate([[1.0], np.cumprod(probs[:-1, 0])])
    at = np.minimum(node_pass, len(probs) - 1)
    return ran & (chain_before[at] * probs[at, node_rank] >= threshold)


def subtree_parents(parents: list[int], keep: np.ndarray) -> list[int]:
    """The parents of the nodes kept (a subset holding every kept node's parent), as indices among them."""
    new_index = np.cumsum(keep) - 1
    old = np.asarray(parents, dtype=np.int64)[keep]
    return np.where(old >= 0, new_index[np.maximum(old, 0)], -1).tolist()


def tree_depth(parents: list[int]) -> int | None:
    """How deep a tree's drafts go (None for a chain, whose depth is its length)."""
    if not parents:
        return None
    depth: list[int] = []
    for parent in parents:
        depth.append(1 + (depth[parent] if parent >= 0 else 0))
    return max(depth)


def tree_layout(parents: np.ndarray, node_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth (1 for the root's children) and ancestor bitmask (bit j: node j of its tree, itself included)
    of every node of several trees at once.

    parents: [N] each node's parent within its own tree (-1: the root); node_start: [N] the index in
    the flat arrays of its tree's node 0. One vectorised pass per tree level."""
    local = np.arange(len(parents)) - node_start
    parent = np.where(parents >= 0, node_start + parents, -1)
    has_parent = parent >= 0
    up = np.where(has_parent, parent, 0)
    depth = np.ones(len(parents), dtype=np.int64)
    mask = np.left_shift(np.int64(1), local).astype(np.int64)
    own = mask.copy()
    while True:  # one round per level: a node takes its parent's depth and ancestors
        new_depth = 1 + np.where(has_parent, depth[up], 0)
        new_mask = own | np.where(has_parent, mask[up], 0)
        if np.array_equal(new_depth, depth) and np.array_equal(new_mask, mask):
            return depth, mask
        depth, mask = new_depth, new_mask


def accept_tree(sampled: np.ndarray, drafts: np.ndarray, parent_row: np.ndarray, chunk_of_row: np.ndarray,
                num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """The path each chunk keeps: the deepest node whose ancestors and itself each equal the token sampled
    at their parent's row (the longest run of drafts the model agrees with, as in a chain).

    sampled: [R] the token sampled at every sampling row; drafts: [R] the draft each row holds (-1 on
    each chunk's root row); parent_row: [R] the row of each row's parent (-1 on root rows); chunk_of_row:
    [R] which chunk each row belongs to. Returns (the kept path's leaf row of each chunk, its depth)."""
    is_root = parent_row < 0
    up = np.where(is_root, 0, parent_row)
    match = is_root | (drafts == sampled[up])
    ok = is_root.copy()
    depth = np.zeros(len(sampled), dtype=np.int64)
    while True:  # one round per level
        new_ok = is_root | (match & ok[up])
        new_depth = np.where(is_root, 0, depth[up] + 1)
        if np.array_equal(new_ok, ok) and np.array_equal(new_depth, depth):
            break
        ok, depth = new_ok, new_depth
    # Deepest kept row per chunk (siblings hold different tokens, so at most one is kept per level).
    score = np.where(ok, depth, -1)
    order = np.lexsort((-score, chunk_of_row))  # by chunk, deepest first
    first = np.searchsorted(chunk_of_row[order], np.arange(num_chunks))
    leaf = order[first]
    return leaf, depth[leaf]


def path_rows(leaf: np.ndarray, depth: np.ndarray, parent_row: np.ndarray) -> list[list[int]]:
    """The rows from each chunk's root to its leaf (1 + depth rows), root first."""
    max_depth = int(depth.max()) if len(depth) else 0
    walk = np.empty((len(leaf), max_depth + 1), dtype=np.int64)
    walk[:, 0] = leaf
    for j in range(1, max_depth + 1):  # one step up per level, every chunk at once
        walk[:, j] = np.where(walk[:, j - 1] >= 0, parent_row[np.maximum(walk[:, j - 1], 0)], -1)
    return [row[: d + 1][::-1].tolist() for row, d in zip(walk, depth.tolist())]
