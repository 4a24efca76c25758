"""The medusa proposer: Medusa heads on the target's last hidden state draft the next step's tokens.

After each forward pass the runner hands it (observe) the hidden state of every sampling chunk's last
kept row: the row that sampled the request's newest token, x[t]. Head i on it guesses x[t + 1 + i]:
exactly the drafts the next step verifies after x[t]. They are kept per request with the position of
x[t], and fill() writes them into the slots the scheduler reserved, when the request's last token is
still at that position (else, e.g. right after a preemption's recompute, a draft is the last token
repeated: verification rejects what is wrong, so any draft is safe, only less useful).

Heads that share the target's LM head (`tokenmill train-medusa`'s) hand the runner their blocks' rows for
every sampling row, which it appends to its own logits matmul (the vocabulary-sized weight read once for
the target and all heads); observe_logits then takes the drafts of each request's last kept row. Heads
with LM heads of their own (FasterDecoding's checkpoints) compute from the kept rows' hidden states.

A chain takes each head's top-1. A token tree (speculative_config's "tree" or "tree_width";
spec_decode/tree.py) takes, for its node at path (r1, ..., rd), head d's candidate of rank rd, as
Medusa does: the heads all read the same hidden state, so a node's guess does not depend on its
parent's token; the tree only tries several of them at once. The scheduler hands each chunk the
tree's first nodes with their parents (spec_parents); a chunk without parents gets the chain.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np
import torch

from tokenmill.engine.messages import DRAFT_PLACEHOLDER, ScheduledChunk
from tokenmill.models.medusa import MedusaHeads
from tokenmill.spec_decode.tree import TokenTree


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, num_speculative_tokens: int, tree: TokenTree | None = None) -> None:
        if num_speculative_tokens > len(heads.heads):
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens} is more than the {len(heads.heads)} Medusa heads")
        self.heads = heads
        self.k = num_speculative_tokens
        # Each node's (head, rank), and how many candidates per head the tree reads (1: a chain).
        self._node_head, self._node_rank = tree.heads_and_ranks() if tree is not None else (np.zeros(0, np.int64),) * 2
        self.width = int(self._node_rank.max()) + 1 if tree is not None else 1
        self._dtype = next(heads.parameters()).dtype  # the model's: the loader put the heads there
        # request id -> (position of its last token, candidates after it [k heads][width ranks])
        self._drafts: dict[str, tuple[int, np.ndarray]] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._drafts.pop(request_id, None)

    def keep_only(self, request_ids: Collection[str]) -> None:
        for request_id in [r for r in self._drafts if r not in request_ids]:
            del self._drafts[request_id]

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """Write drafts into the reserved slots of every chunk that has them."""
        for chunk in chunks:
            k = len(chunk.spec_token_ids)
            if not k or chunk.spec_token_ids[0] != DRAFT_PLACEHOLDER:
                continue
            last_pos = chunk.start_pos + len(chunk.token_ids) - k - 1
            position, candidates = self._drafts.get(chunk.request_id, (-1, None))
            if position != last_pos:
                drafts = [chunk.token_ids[-k - 1]] * k
            elif chunk.spec_parents:  # the tree's first k nodes
                drafts = candidates[self._node_head[:k], self._node_rank[:k]].tolist()
            else:
                drafts = candidates[:k, 0].tolist()
            chunk.spec_token_ids[:] = drafts
            chunk.token_ids[len(chunk.token_ids) - k :] = drafts

    # -- heads that share the target's LM head: their rows ride along its logits matmul ---------------
    def logits_rows(self, sampling_hidden: torch.Tensor) -> torch.Tensor:
        """The heads' rows for the target's LM head, from the hidden states of every sampling row [rows, hidden]."""
        return self.heads.transform(sampling_hidden.to(self._dtype), self.k)

    def observe_logits(self, chunks: list[ScheduledChunk], sampled: list[list[int]], logits: torch.Tensor) -> None:
        """After sampling: the logits of logits_rows' rows [k * rows, vocab]; the drafts of each request come
        from its last kept row."""
        rows, owners = [], []
        first = 0
        for chunk, kept in zip(chunks, sampled):
            if not chunk.sample:
                continue
            rows.append(first + len(kept) - 1)
            owners.append((chunk.request_id, _newest_position(chunk, kept)))
            first += 1 + len(chunk.spec_token_ids)
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        selected = logits.view(self.k, -1, logits.shape[-1])[:, index]  # [k, requests, vocab]: only the rows read
        if self.width == 1:
            candidates = selected.argmax(dim=-1, keepdim=True)
        else:
            candidates = selected.topk(self.width, dim=-1).indices
        self._keep(owners, candidates.transpose(0, 1).cpu().numpy())  # [requests, k, width]

    # -- heads with LM heads of their own (FasterDecoding's layout) ------------------------------------
    def observe(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, sampled: list[list[int]]) -> None:
        """After a forward pass: hidden [tokens, hidden size] of the whole batch (chunk rows in order), and
        each chunk's kept tokens (empty for chunks that did not sample)."""
        rows, owners = [], []
        offset = 0
        for chunk, kept in zip(chunks, sampled):
            if kept:
                # The row after which the last kept token was sampled: the chunk's last real token's row,
                # plus one per draft kept.
                rows.append(offset + len(chunk.token_ids) - len(chunk.spec_token_ids) - 1 + len(kept) - 1)
                owners.append((chunk.request_id, _newest_position(chunk, kept)))
            offset += len(chunk.token_ids)
        if not rows:
            return
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(hidden.device)
        self._keep(owners, self.heads.propose(hidden[index].to(self._dtype), self.k, self.width).cpu().numpy())

    def _keep(self, owners: list[tuple[str, int]], drafts: np.ndarray) -> None:
        """drafts: [requests, k, width] each head's candidates, most likely first."""
        for (request_id, position), row in zip(owners, drafts):
            self._drafts[request_id] = (position, row)


def _newest_position(chunk: ScheduledChunk, kept: list[int]) -> int:
    """The position of the newest of the kept tokens: after the chunk's real tokens and the drafts kept."""
    return chunk.start_pos + len(chunk.token_ids) - len(chunk.spec_token_ids) + len(kept) - 1
