"""Token embedding and LM head, their weights held by a method from the quantization config (by prefix)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.linear import copy_checked


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None, prefix: str = "") -> None:
        super().__init__()
        ctx = ctx or ModelBuildContext()
        self.prefix = prefix
        self.method = ctx.quant_config.embedding_method(prefix)
        self.method.create_weights(self, num_embeddings, embedding_dim, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param, loaded, self.prefix or type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, input_ids)


class LMHead(nn.Module):
    """Logits = hidden @ W^T. Tied to an embedding, it reads the embedding's weight (loaded once)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ModelBuildContext | None = None,
                 prefix: str = "lm_head", tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        ctx = ctx or ModelBuildContext()
        self.prefix = prefix
        self.method = ctx.quant_config.embedding_method(prefix)
        self.tied = tied_to is not None
        if tied_to is None:
            self.method.create_weights(self, num_embeddings, embedding_dim, self.weight_loader)
        else:
            # The same Parameter: named_parameters() lists it once, under the embedding's name.
            self.weight = tied_to.weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param, loaded, self.prefix)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits."""
        return self.method.apply(self, hidden).float()
