"""GPT-2: learned positions, LayerNorm, fused c_attn, GELU MLP, tied LM head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers.activation import get_activation
from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import ModelBuildContext, join_prefix
from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import ColumnParallelLinear, QKVLinear, RowParallelLinear
from tokenmill.layers.norm import LayerNorm
from tokenmill.models.weights import load_named_weights
from tokenmill.layers.attention_metadata import BatchInputs

# HF GPT-2 stores these as Conv1D weights, [in, out]; ours are nn.Linear-shaped [out, in].
_CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, ctx: ModelBuildContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        hidden = config.n_embd
        head_dim = hidden // config.n_head
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        # The checkpoint's c_attn is one fused [q; k; v] tensor: loaded whole, split by heads per rank.
        self.c_attn = QKVLinear(hidden, head_dim, config.n_head, config.n_head, bias=True, ctx=ctx, prefix=join_prefix(prefix, "c_attn"))
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, ctx=ctx, prefix=join_prefix(prefix, "c_proj"),
                                        input_slice=self.c_attn.heads.input_slice(head_dim))
        self.num_heads = self.c_attn.heads.num_heads  # this rank's
        self.attn = Attention(self.num_heads, head_dim, self.num_heads, scale)

    def forward(self, hidden: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, batch))


class GPT2MLP(nn.Module):
    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, bias=True, ctx=ctx, prefix=join_prefix(prefix, "c_fc"))
        self.c_proj = RowParallelLinear(inner, config.n_embd, bias=True, ctx=ctx, prefix=join_prefix(prefix, "c_proj"))
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, ctx: ModelBuildContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = ctx.hf_config
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.attn = GPT2Attention(ctx, layer_idx, join_prefix(prefix, "attn"))
        self.ln_2 = LayerNorm(config.n_embd, config.layer_norm_epsilon)
        self.mlp = GPT2MLP(ctx, join_prefix(prefix, "mlp"))

    def forward(self, hidden: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), batch)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, ctx: ModelBuildContext, prefix: str = "transformer") -> None:
        super().__init__()
        config = ctx.hf_config
        self.wte = VocabEmbedding(config.vocab_size, config.n_embd, ctx=ctx, prefix=join_prefix(prefix, "wte"))
        self.wpe = VocabEmbedding(config.n_positions, config.n_embd, ctx=ctx, prefix=join_prefix(prefix, "wpe"), replicated=True)
        self.h = nn.ModuleList(GPT2Block(ctx, i, join_prefix(prefix, f"h.{i}")) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden, batch)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, ctx: ModelBuildContext) -> None:
        super().__init__()
        self.config = ctx.hf_config
        self.transformer = GPT2Model(ctx, "transformer")
        # GPT-2 always ties the LM head to the token embedding.
        self.lm_head = LMHead(self.config.vocab_size, self.config.n_embd, ctx=ctx, prefix="lm_head", tied_to=self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        return self.transformer(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith("transformer.") and not name.startswith("lm_head."):
                    name = "transformer." + name  # the original gpt2 checkpoints have no prefix
                if name.endswith(_CONV1D_WEIGHTS):
                    tensor = tensor.t()
                yield name, tensor

        load_named_weights(self, renamed(), {}, ignore=("lm_head.weight", ".attn.bias", ".attn.masked_bias"))
