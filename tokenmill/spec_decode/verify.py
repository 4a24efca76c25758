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
