"""Linear layers whose parameters carry a weight_loader, so fused projections load from HF names.

Each layer delegates weight creation and the matmul to a LinearMethod, the hook where
quantized methods (weight-only INT8/INT4, W8A8, FP8) plug in later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def cpu_packed_weights_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked bf16 matmul: on CPUs with native bf16 (AVX512-BF16, AMX)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedCPUWeight:
    """A bf16 weight reordered once into oneDNN's blocked layout, as inductor's freezing pass does.

    F.linear reorders the weight on every call; at decode batch sizes that costs as much as the
    matmul itself (measured: 2-4x faster at one row, 10-40% at 32-64 rows).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class PackedCPULinearMethod(UnquantizedLinearMethod):
    """Unquantized bf16 on CPU with the weight prepacked after loading (the original is freed)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = PackedCPUWeight(layer.weight.data)
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.packed_weight(x, bias)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T + b, loaded from one checkpoint tensor."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, method: UnquantizedLinearMethod | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, output_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        copy_checked(param, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked on the output dim (gate_up_proj); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, method: UnquantizedLinearMethod | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, method)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        index = int(shard_id)
        start = sum(self.output_sizes[:index])
        return start, self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if shard_id is None:  # already fused in the checkpoint
            copy_checked(param, loaded, type(self).__name__)
            return
        start, size = self.shard_range(shard_id)
        copy_checked(param.data.narrow(0, start, size), loaded, f"{type(self).__name__} shard {shard_id}")


class QKVLinear(MergedLinear):
    """Fused q/k/v projection; shard ids 'q', 'k', 'v'."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, method: UnquantizedLinearMethod | None = None) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, method)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        return super().shard_range({"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id))
