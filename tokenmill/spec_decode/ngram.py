"""The ngram proposer (prompt lookup decoding): if the last n tokens of a request occurred earlier in its
prompt or output, guess that what followed them then follows now.

n goes from prompt_lookup_max down to prompt_lookup_min: the longest suffix that occurred before wins,
and among its occurrences the latest (the most recent context is the best guide in edited or repeated
text). Each request is one numpy pass over its tokens: candidates are the positions holding the last
token, then only those are compared over the longer suffixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    min_n: int
    max_n: int
    num_speculative_tokens: int

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) drafts to follow token_ids (int64), or none."""
        k = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        # Candidate match ends: earlier positions (not the last) holding the last token.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if len(ends) == 0:
            return []
        # Suffix length matched at each candidate, up to max_n: compare one step further back at a time.
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, min(self.max_n, length - 1)):
            index = ends - back
            ok = alive & (index >= 0)
            ok[ok] = token_ids[index[ok]] == token_ids[length - 1 - back]
            matched += ok
            alive = ok
            if not alive.any():
                break
        best = int(matched.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
        return token_ids[end + 1 : end + 1 + k].tolist()
