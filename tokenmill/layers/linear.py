"""Linear layers built from a ModelBuildContext: their method comes from the quantization config by
the layer's prefix, and every parameter the method creates carries the layer's weight_loader, so
fused projections (QKV, gate-up) load shard by shard from HF names, whatever the weight format.

With tensor parallelism (Megatron's split, as vLLM does it) a column-parallel layer holds its rank's
slice of the output channels (QKV by heads, gate-up by halves) and a row-parallel layer its slice
of the input channels, then sums the ranks' partial outputs (one all-reduce). The weight loader
takes the rank's slice from the full checkpoint tensor, so every method (quantized ones included,
which quantize after loading) sees only its own shard. With one rank every slice is the whole.

A parameter says where its channels lie: `output_dim` (the axis of output channels; None: every
output channel shares it) and `input_dim` (the axis of input channels; 1 for a 2-D weight by
default, None: not split by input). Pre-quantized checkpoints store several channels per element
along an axis: `output_pack` / `input_pack` channels per element (8 int4 values per int32, or one
scale per group of 128 input channels), so a slice in channels becomes a slice in elements, and one
that does not fall on whole elements (a rank's input channels splitting a quantization group) is
a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.quantization.base import KernelCall, QuantizedInput


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ModelLoadError(f"{what} ({total}) is not divisible by {parts} (tensor parallelism)")
    return total // parts


@dataclass(frozen=True)
class HeadPartition:
    """One rank's attention heads: query heads [first_head, first_head + num_heads) and the KV heads
    they read, [first_kv_head, first_kv_head + num_kv_heads).

    Heads go to ranks by KV group (a KV head with its query heads), as evenly as they go: SmolLM2's
    3 KV groups over 2 ranks give one rank 2 groups and the other 1 (vLLM needs equal shares; uneven
    ones cost balance, not correctness). With fewer KV heads than ranks, each KV head is replicated
    on size / num_kv_heads consecutive ranks, which split its query heads."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> "HeadPartition":
        group = divide(num_heads, num_kv_heads, "the number of attention heads per KV head") if size > 1 else num_heads // num_kv_heads
        if num_kv_heads >= size:
            first_kv, end_kv = rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
            return cls((end_kv - first_kv) * group, end_kv - first_kv, first_kv * group, first_kv)
        if size % num_kv_heads:
            raise ModelLoadError(f"tensor_parallel_size {size} must be at most, or a multiple of, the number of KV heads ({num_kv_heads})")
        replicas = size // num_kv_heads
        local_heads = divide(group, replicas, "the query heads of a KV head")
        kv_head = rank // replicas
        return cls(local_heads, 1, kv_head * group + (rank % replicas) * local_heads, kv_head)

    def input_slice(self, head_dim: int) -> tuple[int, int]:
        """The input channels of the output projection these heads feed (first, count)."""
        return self.first_head * head_dim, self.num_heads * head_dim


@dataclass(frozen=True)
class OutputShard:
    """Where one output shard of a layer (q, k, v, gate, up, or the whole) lies: `size` local channels,
    rows [checkpoint_start, checkpoint_start + size) of the checkpoint's tensor for that shard."""

    checkpoint_start: int
    size: int


class Linear(nn.Module):
    """y = x W^T + b, loaded from one checkpoint tensor (or, for subclasses, several shards). Replicated:
    every rank holds the whole layer."""

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, prefix: str = "") -> None:
        super().__init__()
        ctx = ctx or ModelBuildContext()
        self.tp = ctx.parallel
        self.prefix = prefix
        self.full_output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.shards = self.output_shards(self.full_output_sizes)
        self.output_sizes = [s.size for s in self.shards]
        self.output_size = sum(self.output_sizes)
        self.full_input_size = input_size
        self.input_size = self.local_input_size(input_size)
        self.method = ctx.quant_config.linear_method(prefix)
        self.method.create_weights(self, self.input_size, self.output_sizes, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)

    # -- the tensor-parallel layout (the whole layer here; the subclasses split it) --------------
    def output_shards(self, full_sizes: list[int]) -> list[OutputShard]:
        return [OutputShard(0, size) for size in full_sizes]

    def local_input_size(self, input_size: int) -> int:
        return input_size

    def rank_input_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def _packed(self, param: nn.Parameter, channels: int, pack_attr: str, what: str) -> int:
        """channels as a count of param's elements along its packed axis (pack_attr: its channels per element)."""
        pack = getattr(param, pack_attr, 1)
        if channels % pack:
            raise ModelLoadError(f"{self.prefix or type(self).__name__}: {what} ({channels} channels) do not fall on whole "
                                 f"elements of {pack} channels (packed values, or quantization groups of {pack}): tensor "
                                 "parallelism cannot split them there; use a smaller tensor_parallel_size")
        return channels // pack

    def shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    # -- loading ----------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        what = f"{self.prefix or type(self).__name__}"
        dim = getattr(param, "output_dim", 0)
        loaded = self.rank_input_slice(param, loaded)
        if dim is None:  # shared by every output channel (GPTQ's g_idx): each shard holds the same
            copy_checked(param, loaded, what)
            return
        if shard_id is None and len(self.shards) > 1 and self.tp.size > 1:
            # A fused tensor in the checkpoint (GPT-2's c_attn): split it into its shards, each sliced for this rank.
            start = 0
            for index, full in enumerate(self.full_output_sizes):
                full = self._packed(param, full, "output_pack", f"shard {index}")
                self._load_shard(param, loaded.narrow(dim, start, full), index, dim, what)
                start += full
            return
        if shard_id is None and len(self.shards) > 1:  # the whole fused tensor, one rank
            copy_checked(param, loaded, what)
            return
        self._load_shard(param, loaded, 0 if shard_id is None else self.shard_index(shard_id), dim, what)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, index: int, dim: int, what: str) -> None:
        shard = self.shards[index]
        name = f"shard {index}" if len(self.shards) > 1 else "the output"
        full = self._packed(param, self.full_output_sizes[index], "output_pack", name)
        if loaded.shape[dim] != full or loaded.dim() != param.dim():
            expected = list(param.shape)
            expected[dim] = full
            shard = f" shard {index}" if len(self.shards) > 1 else ""
            raise ModelLoadError(f"{what}{shard}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
        local_start = self._packed(param, sum(self.output_sizes[:index]), "output_pack", f"{name}'s offset")
        start = self._packed(param, shard.checkpoint_start, "output_pack", f"this rank's slice of {name}")
        size = self._packed(param, shard.size, "output_pack", f"this rank's slice of {name}")
        copy_checked(param.data.narrow(dim, local_start, size), loaded.narrow(dim, start, size),
                     f"{what} shard {index}" if len(self.shards) > 1 else what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def decode_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward for 2-D contiguous rows with the weights bound once (a model's decode program)."""
        return self.method.bound_apply(self, self.bias)

    def decode_kernel(self, dtype: torch.dtype) -> KernelCall | None:
        """decode_call's one kernel op for rows of x in dtype, for the C++ decode program; None: it has none."""
        return self.method.decode_kernel(self, self.bias, dtype)

    def quantized_input(self, dtype: torch.dtype) -> QuantizedInput | None:
        """How decode_call's rows in dtype may come quantized by the RMSNorm before the layer; None: as they are."""
        return self.method.quantized_input(self, self.bias, dtype)


class ColumnParallelLinear(Linear):
    """Output channels split over the ranks: each shard (q/k/v, gate/up, or the whole) by the rank's slice."""

    def output_shards(self, full_sizes: list[int]) -> list[OutputShard]:
        tp = self.tp
        sizes = [divide(full, tp.size, f"{self.prefix or 'a layer'}'s output size") for full in full_sizes]
        return [OutputShard(tp.rank * size, size) for size in sizes]


class RowParallelLinear(Linear):
    """Input channels split over the ranks; the ranks' partial outputs are summed (all-reduce), and the
    bias added once (by rank 0). input_slice: this rank's (first input channel, count), when the split
    is not even (o_proj follows its rank's attention heads); by default an even split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, ctx: ModelBuildContext | None = None,
                 prefix: str = "", input_slice: tuple[int, int] | None = None) -> None:
        self.input_slice = input_slice
        super().__init__(input_size, output_size, bias, ctx=ctx, prefix=prefix)

    def local_input_size(self, input_size: int) -> int:
        if self.input_slice is None:
            size = divide(input_size, self.tp.size, f"{self.prefix or 'a layer'}'s input size")
            self.input_slice = (self.tp.rank * size, size)
        return self.input_slice[1]

    def rank_input_slice(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = getattr(param, "input_dim", 1 if loaded.dim() >= 2 else None)
        if dim is None or self.tp.size == 1:  # the bias (every output channel, whole), or a per-channel scale
            return loaded
        full = self._packed(param, self.full_input_size, "input_pack", "the input")
        if loaded.shape[dim] != full:
            raise ModelLoadError(f"{self.prefix}: checkpoint tensor has {loaded.shape[dim]} input elements, expected {full}")
        first, count = self.input_slice
        what = f"this rank's input channels [{first}, {first + count})"
        return loaded.narrow(dim, self._packed(param, first, "input_pack", what), self._packed(param, count, "input_pack", what))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.apply(self, x, self.bias)
        y = self.method.apply(self, x, self.bias if self.tp.is_driver else None)
        return self.tp.all_reduce(y.contiguous())

    def decode_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return super().decode_call() if self.tp.size == 1 else self.forward  # the ranks' sum: forward's all-reduce

    def decode_kernel(self, dtype: torch.dtype) -> KernelCall | None:
        return super().decode_kernel(dtype) if self.tp.size == 1 else None


class MergedLinear(ColumnParallelLinear):
    """Several projections of the same input stacked on the output dim (gate_up_proj); shard_id is the index."""


class QKVLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard ids 'q', 'k', 'v'. Split by heads: each rank its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 ctx: ModelBuildContext | None = None, prefix: str = "") -> None:
        ctx = ctx or ModelBuildContext()
        self.head_dim = head_dim
        self.heads = HeadPartition.of(num_heads, num_kv_heads, ctx.parallel.rank, ctx.parallel.size)
        self.q_size = self.heads.num_heads * head_dim
        self.kv_size = self.heads.num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         ctx=ctx, prefix=prefix)

    def output_shards(self, full_sizes: list[int]) -> list[OutputShard]:
        q = OutputShard(self.heads.first_head * self.head_dim, self.q_size)
        kv = OutputShard(self.heads.first_kv_head * self.head_dim, self.kv_size)
        return [q, kv, kv]

    def shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
