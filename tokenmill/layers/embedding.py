"""Token embedding and LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import PackedCPUWeight, copy_checked


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param, loaded, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


def project_logits(hidden: torch.Tensor, weight: torch.Tensor, packed: PackedCPUWeight | None) -> torch.Tensor:
    """Float32 logits from the LM head weight, or from its prepacked copy (CPU bf16)."""
    return (packed(hidden) if packed is not None else F.linear(hidden, weight)).float()
