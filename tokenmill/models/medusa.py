"""Medusa heads (Cai et al. 2024; the FasterDecoding/Medusa checkpoint layout): extra heads on the
target's last hidden state, head i guessing the token i + 2 positions ahead (the model's own LM head
gives the next one). Each head is `medusa_num_layers` residual blocks, x + SiLU(W x + b), then an LM
head of its own. The target's weights are untouched: the heads only read its final hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MedusaHead(nn.Module):
    """shared_lm_head: the head has no LM head of its own; the target's turns its blocks' output into
    logits (tokenmill's own variant: the runner then appends the heads' rows to the target's logits
    matmul, so the vocabulary-sized weight is read once per step for the target and every head)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, shared_lm_head: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        self.lm_head = None if shared_lm_head else nn.Linear(hidden_size, vocab_size, bias=False)

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual blocks: what the LM head reads."""
        for block in self.blocks:
            hidden = hidden + F.silu(block(hidden))
        return hidden

    def forward(self, hidden: torch.Tensor, lm_head=None) -> torch.Tensor:
        """Logits [rows, vocab] from final hidden states [rows, hidden] (lm_head: the shared one, if so)."""
        return (self.lm_head or lm_head)(self.transform(hidden))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, shared_lm_head: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.shared_lm_head = shared_lm_head
        self.heads = nn.ModuleList(MedusaHead(hidden_size, vocab_size, num_layers, shared_lm_head) for _ in range(num_heads))

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, k: int, width: int = 1) -> torch.Tensor:
        """Each row's candidates [rows, k, width]: the first k heads' `width` most likely tokens, most likely
        first (heads with their own LM heads; width 1: a chain's drafts)."""
        if width == 1:
            return torch.stack([head(hidden).argmax(dim=-1, keepdim=True) for head in self.heads[:k]], dim=1)
        return torch.stack([head(hidden).topk(width, dim=-1).indices for head in self.heads[:k]], dim=1)

    @torch.inference_mode()
    def transform(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The first k heads' blocks on every row, head-major [k * rows, hidden]: rows for the shared LM head."""
        return torch.cat([head.transform(hidden) for head in self.heads[:k]])

    def load_medusa_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """FasterDecoding's keys: `{head}.{block}.linear.weight|bias` for the residual blocks and
        `{head}.{num_layers}.weight` for the head's LM head (its nn.Sequential indices; none when shared)."""
        ours = {}
        for i in range(len(self.heads)):
            for j in range(self.num_layers):
                ours[f"heads.{i}.blocks.{j}.weight"] = f"{i}.{j}.linear.weight"
                ours[f"heads.{i}.blocks.{j}.bias"] = f"{i}.{j}.linear.bias"
            if not self.shared_lm_head:
                ours[f"heads.{i}.lm_head.weight"] = f"{i}.{self.num_layers}.weight"
        missing = sorted(theirs for theirs in ours.values() if theirs not in state)
        if missing:
            raise KeyError(f"the Medusa checkpoint lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        params = dict(self.named_parameters())
        for name, theirs in ours.items():
            tensor = state[theirs]
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"the Medusa checkpoint's {theirs} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        """The heads under FasterDecoding's keys (what `tokenmill train-medusa` writes)."""
        state = {}
        for i, head in enumerate(self.heads):
            for j, block in enumerate(head.blocks):
                state[f"{i}.{j}.linear.weight"] = block.weight.detach().contiguous()
                state[f"{i}.{j}.linear.bias"] = block.bias.detach().contiguous()
            if head.lm_head is not None:
                state[f"{i}.{self.num_layers}.weight"] = head.lm_head.weight.detach().contiguous()
        return state
