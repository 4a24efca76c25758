"""Speculative decoding counters, as vLLM's metrics count them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # chunks that carried drafts
    num_draft_tokens: int = 0  # drafts proposed and verified (every node of a token tree)
    num_accepted_tokens: int = 0  # drafts kept
    # accepted_per_pos[i]: how often the draft at position i was kept (it and every draft before it);
    # for a token tree, the kept path's node at depth i + 1.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, num_positions: int | None = None) -> None:
        """num_positions: how many positions the drafts cover (a tree's depth; a chain's is num_drafts)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        positions = num_drafts if num_positions is None else num_positions
        if len(self.accepted_per_pos) < positions:
            self.accepted_per_pos.extend([0] * (positions - len(self.accepted_per_pos)))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept over drafts proposed (0 when none were proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: 1 + the drafts kept, averaged (vLLM's mean acceptance length)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))
