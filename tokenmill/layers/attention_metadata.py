"""The attention metadata of one forward pass: what the attention layers read besides the tensors.

It lives beside the attention layer (layers/ and models/ import nothing from the engine or the
worker); worker/batch.py builds it from the scheduled chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def head_major_rows(index: torch.Tensor, num_kv_heads: int, rows_per_head: int) -> torch.Tensor:
    """Rows of a head-major cache viewed as [num_kv_heads * rows_per_head, ...] for the given per-head
    row indices (blocks or slots): head 0's rows in index order, then head 1's, and so on."""
    heads = torch.arange(num_kv_heads, device=index.device)[:, None] * rows_per_head
    return (heads + index.flatten()[None, :]).flatten()


@dataclass
class AttentionGroup:
    """Requests of one shape class (decodes, or prompt chunks) padded to a common query length.

    Decodes and prompt chunks are attended in separate groups so that 32 decodes in a batch
    with one long prompt chunk are not padded to the chunk's length.
    """

    token_index: torch.Tensor  # [b, max_q] rows of the step's tokens; padding points at a scratch row
    block_table: torch.Tensor  # [b, num_blocks] the blocks holding each request's context
    query_pos: torch.Tensor  # [b, max_q] position of each query token
    from_start: bool = False  # every request's chunk starts at position 0 (a whole or first prompt chunk)
    # A decode group's shared prefix for cascade attention: (prefix_len, the blocks holding positions
    # 0 .. prefix_len - 1, the same physical blocks at the start of every row's block table); None: none used.
    shared_prefix: tuple[int, torch.Tensor] | None = None
    # Token trees (decode groups only; spec_decode/tree.py): row b sees its context before slot
    # tree_start[b] and the tree slots tree_start[b] + j whose bit j is set in tree_mask[b] (its
    # ancestors and itself); 0: a plain row, causal up to query_pos. None: no tree in the step.
    tree_start: torch.Tensor | None = None  # [b]
    tree_mask: torch.Tensor | None = None  # [b] int64 bitmask
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _kv_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _decode_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    _prompt_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def decode_rows_and_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode group's token rows and query positions, one per request, contiguous (made once per step)."""
        if self._decode_inputs is None:
            self._decode_inputs = (self.token_index[:, 0].contiguous(), self.query_pos[:, 0].contiguous())
        return self._decode_inputs

    def prompt_rows_starts_lens(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt group's first token row, start position and query length per request (made once per step).

        A chunk's tokens are consecutive rows of the step; its padded slots point at the scratch row
        num_tokens, and every real row is below it."""
        if self._prompt_inputs is None:
            self._prompt_inputs = (
                self.token_index[:, 0].contiguous(),
                self.query_pos[:, 0].contiguous(),
                (self.token_index < num_tokens).sum(dim=1),
            )
        return self._prompt_inputs

    def kv_rows(self, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
        """Rows of a head-major cache viewed as [num_kv_heads * num_blocks, ...] holding the group's
        context: head h's blocks first, then head h + 1's, each request's blocks in order."""
        key = (num_kv_heads, num_blocks)
        rows = self._kv_rows.get(key)
        if rows is None:
            rows = self._kv_rows[key] = head_major_rows(self.block_table, num_kv_heads, num_blocks)
        return rows

    def mask(self, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
        """Boolean [b, 1, max_q, num_blocks * block_size]: causal over the request's own context (a tree
        node: its context before the tree, and its ancestors in the tree)."""
        cached = self._masks.get(sliding_window)
        if cached is None:
            kv_pos = torch.arange(self.block_table.shape[1] * block_size, device=self.query_pos.device)
            q_pos = self.query_pos[:, :, None]
            cached = kv_pos <= q_pos
            if sliding_window is not None:
                cached &= kv_pos > q_pos - sliding_window
            if self.tree_start is not None:
                start, bits = self.tree_start[:, None, None], self.tree_mask[:, None, None]
                rel = kv_pos - start
                in_tree = (rel >= 0) & (rel < 64) & ((bits >> rel.clamp(0, 63)) & 1).bool()
                cached = torch.where(bits != 0, (cached & (rel < 0)) | in_tree, cached)
            cached = cached[:, None]
            self._masks[sliding_window] = cached
        return cached


@dataclass
class BatchInputs:
    """One forward pass's inputs; the tensors are on the model's device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot of each new token: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B] context length after this step
    block_tables: torch.Tensor  # [B, max_blocks], padded with the null block 0
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    attn_groups: list[AttentionGroup]  # decodes (if any) first, then prompt chunks by decreasing length
    block_size: int
    num_tokens: int
    _slot_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> "BatchInputs":
        """The same inputs on another device (a tensor-parallel rank's), without the per-step caches."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else move(t)

        groups = [AttentionGroup(move(g.token_index), move(g.block_table), move(g.query_pos), g.from_start,
                                 None if g.shared_prefix is None else (g.shared_prefix[0], move(g.shared_prefix[1])),
                                 maybe(g.tree_start), maybe(g.tree_mask))
                  for g in self.attn_groups]
        return BatchInputs(move(self.input_ids), move(self.positions), move(self.slot_mapping), move(self.query_start_loc),
                           move(self.seq_lens), move(self.block_tables), move(self.logits_indices), groups, self.block_size, self.num_tokens)

    def plain_decode_group(self) -> AttentionGroup | None:
        """The batch's one group when it is nothing but plain decodes (a token per row, attended without a
        shared-prefix cascade; a token tree's rows among them carry their tree_start / tree_mask), in the
        step's row order; None for any other batch."""
        if len(self.attn_groups) != 1:
            return None
        group = self.attn_groups[0]
        if group.token_index.shape[1] != 1 or group.shared_prefix is not None:
            return None
        return group

    def slot_rows(self, num_kv_heads: int, num_slots: int) -> torch.Tensor:
        """Rows of a head-major cache viewed as [num_kv_heads * num_slots, head_dim] where the new
        tokens' K/V go: head h's slots first, then head h + 1's (computed once per step)."""
        key = (num_kv_heads, num_slots)
        rows = self._slot_rows.get(key)
        if rows is None:
            rows = self._slot_rows[key] = head_major_rows(self.slot_mapping, num_kv_heads, num_slots)
        return rows
