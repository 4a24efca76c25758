"""Where requests go.

Online (Router): each request to the replica with the fewest outstanding requests; among replicas with
equally few, the one that last took a request whose prompt starts with the same first KV block (its
prefix cache may still hold that block and what follows), else the lowest-numbered one.

Offline (balanced_assignment): a whole batch known at once is split so that each replica gets about the
same work, prompt tokens plus the tokens it may generate, largest first (the LPT rule).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# First blocks remembered for affinity (least recently used ones forgotten first): bounded memory.
MAX_AFFINITY_KEYS = 65536


def prompt_token_ids(prompt: Any) -> Sequence[int] | None:
    """The prompt's token ids when the caller gave them (the server always does), else None."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return ids if isinstance(ids, Sequence) and not isinstance(ids, str) else None
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):
        return prompt
    return None


def first_block(prompt: Any, block_size: int) -> tuple[int, ...] | None:
    """The key of a prompt's first full KV block (the unit the prefix cache reuses); None if it has none."""
    ids = prompt_token_ids(prompt)
    if ids is None or len(ids) < block_size:
        return None
    try:
        return tuple(int(t) for t in ids[:block_size])
    except (TypeError, ValueError):
        return None  # not token ids: the replica refuses the request with a clear error


class Router:
    """Outstanding requests per replica, and which replica last took each first block."""

    def __init__(self, size: int, block_size: int) -> None:
        self.block_size = block_size
        self.load = [0] * size
        self._last: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def choose(self, prompt: Any, candidates: Sequence[int]) -> int:
        """The replica (one of candidates) for this prompt, by the rule in the module docstring."""
        if not candidates:
            raise ValueError("no replica to route to")
        least = min(self.load[i] for i in candidates)
        tied = [i for i in candidates if self.load[i] == least]
        key = first_block(prompt, self.block_size)
        if key is not None and self._last.get(key) in tied:
            return self._last[key]
        return tied[0]

    def started(self, index: int, prompt: Any) -> None:
        """Replica `index` took this prompt's request."""
        self.load[index] += 1
        key = first_block(prompt, self.block_size)
        if key is not None:
            self._last[key] = index
            self._last.move_to_end(key)
            if len(self._last) > MAX_AFFINITY_KEYS:
                self._last.popitem(last=False)

    def finished(self, index: int) -> None:
        """A request of replica `index` ended (finished, aborted, refused or failed)."""
        self.load[index] -= 1


def balanced_assignment(costs: Sequence[float], size: int) -> list[int]:
    """The replica of each item: items taken largest cost first, each to the replica with the least total cost
    so far (ties: the lowest index). Deterministic: the same batch is always split the same way."""
    totals = [0.0] * size
    assignment = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        replica = min(range(size), key=lambda r: (totals[r], r))
        assignment[item] = replica
        totals[replica] += costs[item]
    return assignment


def estimated_cost(prompt: Any, params: Any, max_model_len: int) -> float:
    """A request's work in tokens: its prompt (token ids, or about 4 characters a token for text) plus the
    tokens it may generate (max_tokens, up to the context, times its sequences)."""
    ids = prompt_token_ids(prompt)
    if ids is not None:
        prompt_len = len(ids)
    else:
        text = prompt.get("prompt", "") if isinstance(prompt, dict) else prompt
        prompt_len = len(text) / 4 if isinstance(text, str) else 1
    room = max(max_model_len - prompt_len, 1)
    max_tokens = getattr(params, "max_tokens", None)
    output_len = room if max_tokens is None else min(max_tokens, room)
    sequences = getattr(params, "num_sequences", None) or getattr(params, "beam_width", None) or 1
    return prompt_len + output_len * sequences
