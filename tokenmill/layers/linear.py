"""Linear layers built from a ModelBuildContext: their method comes from the quantization config by
the layer's prefix, and every parameter the method creates carries the layer's weight_loader, so
fused projections (QKV, gate-up) load shard by shard from HF names, whatever the weight format."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.build_context import ModelBuildContext


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T + b, loaded from one checkpoint tensor (or, for subclasses, several shards)."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, prefix: str = "") -> None:
        super().__init__()
        ctx = ctx or ModelBuildContext()
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.method = ctx.quant_config.linear_method(prefix)
        self.method.create_weights(self, input_size, self.output_sizes, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        """Output channels [start, start + size) of one shard of a fused layer."""
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        what = f"{self.prefix or type(self).__name__}"
        if shard_id is None:  # the whole tensor (a plain layer, or already fused in the checkpoint)
            copy_checked(param, loaded, what)
            return
        start, size = self.shard_range(shard_id)
        dim = getattr(param, "output_dim", 0)
        copy_checked(param.data.narrow(dim, start, size), loaded, f"{what} shard {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked on the output dim (gate_up_proj); shard_id is the index."""


class QKVLinear(Linear):
    """Fused q/k/v projection; shard ids 'q', 'k', 'v'."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, prefix: str = "") -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, ctx=ctx, prefix=prefix)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        return super().shard_range({"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id))
