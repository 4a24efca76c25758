"""Which draft tokens a step keeps.

Row i of a chunk with k drafts samples the token after drafts[:i], with the request's own random
stream at that output index: exactly the token non-speculative decoding would sample there, once
drafts[:i] are what it would have sampled before. So the rule is: keep the drafts while each equals
the token sampled at its position, then the sampled token at the first difference (or after the last
draft). Every kept token is the target model's own sample, so the output is the target's
distribution, and token for token what decoding without speculation gives with the same seed, greedy
or not; a draft that guesses well is kept more often, one that guesses badly only costs its rows.
"""

from __future__ import annotations

import numpy as np

from tokenmill.spec_decode.tree import accept_tree, path_rows


def num_kept(sampled: np.ndarray, drafts: np.ndarray, rows_per_chunk: np.ndarray) -> np.ndarray:
    """Tokens kept per chunk: 1 + the number of leading drafts equal to the token sampled at their row.

    sampled: [R] the token sampled at every row, chunk after chunk (each chunk's 1 + k rows in order);
    drafts: [R] the draft each row verifies, aligned with sampled (-1 on each chunk's last row);
    rows_per_chunk: [C] 1 + k of each chunk.
    """
    if len(rows_per_chunk) == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(rows_per_chunk) - rows_per_chunk
    local = np.arange(len(sampled)) - np.repeat(starts, rows_per_chunk)
    # A chunk's first mismatch: its last row always mismatches (its draft is -1), so every chunk has one.
    mismatch_at = np.where(sampled != drafts, local, np.iinfo(np.int64).max)
    return np.minimum.reduceat(mismatch_at, starts) + 1


def draft_rows(spec_token_ids: list[list[int]]) -> np.ndarray:
    """[R] the draft each sampled row verifies (see num_kept), for chunks with these drafts."""
    return np.fromiter(
        (t for drafts in spec_token_ids for t in (*drafts, -1)),
        dtype=np.int64,
        count=sum(len(d) + 1 for d in spec_token_ids),
    )


def kept_tree_rows(sampled: np.ndarray, spec_token_ids: list[list[int]], spec_parents: list[list[int]]) -> list[list[int]]:
    """The rows each chunk keeps when some chunks' drafts are trees (spec_decode/tree.py): per chunk, its
    sampling rows (0: its last real token's; 1 + i: draft i's) from the root down the longest path of
    drafts each equal to the token sampled at their parent's row. The tokens sampled at those rows are
    the ones kept: as for a chain, every one is the target's own sample after exactly the tokens
    decoding without speculation would have produced (the random stream is keyed by output index, and
    a node's row samples at its depth's). A chunk without parents is a chain: parents -1, 0, 1, ...

    sampled: [R] the token sampled at every row, chunk after chunk (1 + k rows each)."""
    counts = np.fromiter((len(d) for d in spec_token_ids), dtype=np.int64, count=len(spec_token_ids))
    rows_per_chunk = counts + 1
    first = np.cumsum(rows_per_chunk) - rows_per_chunk
    # Each row's parent as a local node index (-2: a root row), then as a row of the step.
    local_parent = np.fromiter(
        (p for drafts, parents in zip(spec_token_ids, spec_parents) for p in (-2, *(parents or range(-1, len(drafts) - 1)))),
        dtype=np.int64, count=int(rows_per_chunk.sum()),
    )
    chunk_of_row = np.repeat(np.arange(len(counts)), rows_per_chunk)
    parent_row = np.where(local_parent == -2, -1, first[chunk_of_row] + 1 + local_parent)
    held = np.fromiter((t for drafts in spec_token_ids for t in (-1, *drafts)), dtype=np.int64, count=len(local_parent))
    leaf, depth = accept_tree(sampled, held, parent_row, chunk_of_row, len(counts))
    return [[r - f for r in rows] for rows, f in zip(path_rows(leaf, depth, parent_row), first.tolist())]
