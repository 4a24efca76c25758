"""Token embedding and LM head, their weights held by a method from the quantization config (by prefix).

With tensor parallelism both are vocab-parallel (as in vLLM): each rank holds a slice of
ceil(vocab / ranks) rows (the last slice padded with zero rows). The embedding looks up the ids in
its slice, zeroes the others and sums over the ranks; the LM head computes its slice's logits and
gathers them on rank 0, the one rank that samples.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import copy_checked


class _VocabShard(nn.Module):
    """The rows [vocab_start, vocab_end) of a [vocab, hidden] weight this rank holds (all of them with one rank)."""

    def __init__(self, num_embeddings: int, ctx: ModelBuildContext, prefix: str, replicated: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp = ctx.parallel
        self.num_embeddings = num_embeddings
        parts = 1 if replicated else self.tp.size
        self.shard_rows = -(-num_embeddings // parts)
        self.vocab_start = 0 if replicated else min(self.tp.rank * self.shard_rows, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.shard_rows, num_embeddings)
        self.sharded = parts > 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        what = self.prefix or type(self).__name__
        if not self.sharded:
            copy_checked(param, loaded, what)
            return
        if loaded.shape[0] != self.num_embeddings:
            raise ModelLoadError(f"{what}: checkpoint tensor has {loaded.shape[0]} rows, expected {self.num_embeddings}")
        rows = self.vocab_end - self.vocab_start
        copy_checked(param.data[:rows], loaded[self.vocab_start : self.vocab_end], what)
        param.data[rows:].zero_()  # the padding rows of the last slice


class VocabEmbedding(_VocabShard):
    """replicated: every rank holds the whole table (GPT-2's position embedding: it is small, and
    sharding it would cost an all-reduce)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None, prefix: str = "",
                 replicated: bool = False) -> None:
        ctx = ctx or ModelBuildContext()
        super().__init__(num_embeddings, ctx, prefix, replicated)
        self.method = ctx.quant_config.embedding_method(prefix)
        self.method.create_weights(self, self.shard_rows, embedding_dim, self.weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return self.method.embedding(self, input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        hidden = self.method.embedding(self, local_ids).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(hidden.contiguous())


class LMHead(_VocabShard):
    """Logits = hidden @ W^T. Tied to an embedding, it reads the embedding's weight (loaded once)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None,
                 prefix: str = "lm_head", tied_to: VocabEmbedding | None = None) -> None:
        ctx = ctx or ModelBuildContext()
        super().__init__(num_embeddings, ctx, prefix, replicated=False)
        self.method = ctx.quant_config.embedding_method(prefix)
        self.tied = tied_to is not None
        if tied_to is None:
            self.method.create_weights(self, self.shard_rows, embedding_dim, self.weight_loader)
        else:
            # The same Parameter: named_parameters() lists it once, under the embedding's name.
            self.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary; with several ranks, on rank 0 only (None elsewhere)."""
        logits = self.method.apply(self, hidden).float()
        if not self.sharded:
            return logits
        gathered = self.tp.gather_to_driver(logits, dim=-1)
        return gathered[:, : self.num_embeddings] if gathered is not None else None
