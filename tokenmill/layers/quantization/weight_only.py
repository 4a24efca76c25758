"""Weight-only quantization, quantized at load from any float checkpoint: `int8` (W8A16, per output
channel) and `int4` (W4A16, group-wise, symmetric or asymmetric). Activations stay in the model dtype.

A decode step (a few rows) runs the CPU kernels, which read the packed weights once and widen
them in registers; a prompt chunk (many rows) is cheaper as one dequantize to the model dtype and
the float GEMM, since its cost is the multiply, not the bytes read. The LM head (tied or not) is
int8 under both methods, as llama.cpp keeps its output matrix at 6-8 bits: it is a fifth of a small
model's bytes, and 4 bits there cost more accuracy than anywhere else. The input embedding stays
in the model dtype (it only gathers rows).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization import quant_utils
from tokenmill.layers.quantization.base import (
    EmbeddingMethodBase,
    KernelCall,
    LinearMethodBase,
    QuantizationConfig,
    WeightLoader,
    as_rows,
    float_weight_to_quantize,
    free_parameter,
)
from tokenmill.layers.quantization.unquantized import UnquantizedEmbeddingMethod, is_lm_head

logger = logging.getLogger(__name__)

# Rows up to which the kernels run (a prompt chunk beyond it dequantizes the layer, then runs the float
# GEMM). benchmarks/quant_linear.py measures the crossing per layer (Zen 5, SmolLM2's shapes, whose
# dequantized weights stay in cache): at 64 rows bf16 int8 ties (585 against 576 us on gate-up) and
# int4 wins (294-326 against 564), AVX2 float32 int8 wins (608 against 912 us on down) and int4
# loses by a fifth (1,116 against 912); a larger model's dequantized weight goes to memory and back,
# which moves the crossing up (a 1B Llama's 32-token prompt: ~0.4 s of dequantize for 0.15 s of GEMM).
KERNEL_MAX_ROWS = 64


def _use_kernels(x: torch.Tensor, max_rows: int = KERNEL_MAX_ROWS) -> bool:
    return x.shape[0] <= max_rows and cpu_kernels.use_cpu_kernels(x)


def _store_int8(layer: nn.Module) -> None:
    store_int8(layer, *quant_utils.quantize_int8(layer.weight.data))


def _on_kernels(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and cpu_kernels.cpu_kernels_available()


def store_int8(layer: nn.Module, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """int8 weights q [N, K] with a scale per output channel [N]: W = q * scale. Where the CPU kernels run,
    q is held in their tiled layout (int8_pack, decode_linear.cpp), which their dequantize reads too."""
    layer.out_features = qweight.shape[0]
    qweight = qweight.to(torch.int8).contiguous()
    on_kernels = _on_kernels(qweight)
    layer.register_buffer("qweight", cpu_kernels.int8_pack(qweight) if on_kernels else qweight, persistent=False)
    layer.register_buffer("weight_scale", scale.float().reshape(-1).contiguous(), persistent=False)
    general = functools.partial(_int8_rows, layer.qweight, layer.weight_scale, layer.out_features)
    layer.linear_call = KernelLinear(torch.ops.tokenmill_cpu.int8_linear.default, (layer.qweight, layer.weight_scale, layer.out_features),
                                     general) if on_kernels else general


def store_int4(layer: nn.Module, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> None:
    """quant_utils' int4 (packed [N, K / 2], scale and min [N, groups]): W = q * scale + min. Where the CPU
    kernels run, held in their tiled layout (int4_pack, decode_linear.cpp), which their dequantize reads too,
    with the scales and mins in fp16 where that holds them exactly (quantize_int4's, GGUF's Q4_0/Q4_1),
    else float32 (a GPTQ/AWQ zero point times its scale)."""
    layer.out_features = packed.shape[0]
    quantized = (packed.contiguous(), scale.float().contiguous(), minimum.float().contiguous())
    on_kernels = _on_kernels(packed)
    if on_kernels:
        quantized = int4_tiles(*quantized)
    for name, tensor in zip(("qweight", "weight_scale", "weight_min"), quantized):
        layer.register_buffer(name, tensor, persistent=False)
    layer.linear_call = int4_linear_call((*quantized, group_size), layer.out_features, on_kernels)


def int4_tiles(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quant_utils' int4 in the kernels' layout (int4_pack), scales and mins in fp16 where it holds them exactly;
    no mins at all (an empty tensor) where every one is -8 x its scale (symmetric groups, GGUF's Q4_0)."""
    scale, minimum = scale.float(), minimum.float()
    if torch.equal(minimum, -8.0 * scale):
        minimum = scale.new_empty(0)
    if all(torch.equal(t.half().float(), t) for t in (scale, minimum)):
        scale, minimum = scale.half(), minimum.half()
    return cpu_kernels.int4_pack(packed.contiguous(), scale.contiguous(), minimum.contiguous())


def quantized_linear(x: torch.Tensor, bias: torch.Tensor | None, kernel: Callable[[torch.Tensor], torch.Tensor],
                      dequantized: Callable[[torch.dtype, bool], torch.Tensor], max_rows: int = KERNEL_MAX_ROWS) -> torch.Tensor:
    """kernel(rows) for up to max_rows rows; otherwise the float GEMM on the weight dequantized to
    x's dtype (dequantized(dtype, by the C++ kernels or in PyTorch))."""
    flat = as_rows(x)
    if _use_kernels(flat, max_rows):
        y = kernel(flat)
    else:
        y = F.linear(flat, dequantized(x.dtype, cpu_kernels.use_cpu_kernels(flat)), bias)
    return y.view(*x.shape[:-1], y.shape[-1])


class KernelLinear:
    """A quantized layer's linear on the CPU kernels with its weight arguments bound once: 2-D contiguous
    rows, up to KERNEL_MAX_ROWS of them (any number in the `any_rows_dtypes`), call the op straight away;
    anything else takes `general` (x, bias). Set on the layer as `linear_call` (a plain attribute, not a
    buffer: nn.Module's attribute lookup costs ~0.5 us each). The general path's checks, lookups and op
    resolution cost ~5 us a call: measured on SmolLM2 with int4 (Zen 5), 2.04 ms a token of everything
    but the matmuls against 1.44 ms unquantized, at 121 calls a token."""

    __slots__ = ("op", "weights", "general", "any_rows_dtypes")

    def __init__(self, op: Callable, weights: tuple, general: Callable, any_rows_dtypes: tuple[torch.dtype, ...] = ()) -> None:
        self.op, self.weights, self.general, self.any_rows_dtypes = op, weights, general, any_rows_dtypes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and (x.shape[0] <= KERNEL_MAX_ROWS or x.dtype in self.any_rows_dtypes) and x.is_contiguous():
            return self.op(x, *self.weights, bias)
        return self.general(x, bias)

    def bound(self, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """self(x, bias) for 2-D contiguous rows, as a function of x alone (LinearMethodBase.bound_apply)."""
        op, weights, general, any_rows = self.op, self.weights, self.general, self.any_rows_dtypes

        def call(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] <= KERNEL_MAX_ROWS or x.dtype in any_rows:
                return op(x, *weights, bias)
            return general(x, bias)

        return call

    def decode_kernel(self, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall:
        """bound(bias)'s op call for rows of x in dtype (LinearMethodBase.decode_kernel)."""
        return KernelCall(self.op.name(), (*self.weights, bias), None if dtype in self.any_rows_dtypes else KERNEL_MAX_ROWS)


def bound_linear_call(call: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                      bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """bound_apply of a layer whose apply is a linear_call (x, bias)."""
    if isinstance(call, KernelLinear):
        return call.bound(bias)
    return lambda x: call(x, bias)


def linear_call_kernel(call: Callable, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
    """decode_kernel of a layer whose apply is a linear_call (x, bias): a KernelLinear's op, else None."""
    return call.decode_kernel(bias, dtype) if isinstance(call, KernelLinear) else None


def int8_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias for a layer stored by store_int8."""
    return layer.linear_call(x, bias)


def _int8_rows(qweight: torch.Tensor, scale: torch.Tensor, out_features: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    def dequantized(dtype: torch.dtype, with_kernels: bool) -> torch.Tensor:
        if with_kernels:
            return cpu_kernels.int8_dequantize(qweight, scale, out_features, dtype)
        return quant_utils.dequantize_int8(qweight, scale).to(dtype)

    return quantized_linear(x, bias, lambda rows: cpu_kernels.int8_linear(rows, qweight, scale, out_features, bias), dequantized)


def int4_linear_call(quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], out_features: int, on_kernels: bool,
                     int8_activations: bool = False) -> Callable:
    """linear_call (x, bias) of an int4 weight held as (int4_tiles or packed, scale, min, group_size).
    int8_activations: x quantized to int8 per block of 32 features (int4_linear_a8, as llama.cpp computes
    Q4_0), the kernel at every row count in every dtype: a 1B Llama's 8192 x 2048 gate-up in Q4_0 (Zen 5,
    bf16, us, int4_linear_a8 against the prepacked bf16 GEMM of the float weight): 88 / 333 at 1 row, 516
    / 837 at 16, 7,932 / 8,649 at 256; float32 at 256: 9,376 / 48,584. Otherwise bf16 activations
    multiplied by pairs (vdpbf16ps, AVX512-BF16) take the kernel at every row count: it keeps up with the
    prepacked bf16 GEMM (a 1B Llama's 256-token prompt: 648 ms against 577 unquantized and 1,222 through
    dequantize + GEMM); other activations up to KERNEL_MAX_ROWS."""
    if not on_kernels:
        any_rows: tuple[torch.dtype, ...] = ()
    elif int8_activations:
        any_rows = (torch.float32, torch.bfloat16, torch.float16)
    else:
        any_rows = (torch.bfloat16,) if cpu_kernels.bf16_pairs() else ()
    kernel = cpu_kernels.int4_linear_a8 if int8_activations else cpu_kernels.int4_linear
    general = functools.partial(_int4_rows, quantized, out_features, any_rows, kernel)
    if not on_kernels:
        return general
    op = torch.ops.tokenmill_cpu.int4_linear_a8 if int8_activations else torch.ops.tokenmill_cpu.int4_linear
    return KernelLinear(op.default, (*quantized, out_features), general, any_rows)


def int8_group_tiles(q: torch.Tensor, scale: torch.Tensor,
                     super_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 q [N, K] with a scale per row and group ([N, groups], fp16 or float32: kept as it is; or int8 times
    super_scale [N, supers] fp16, one per run of groups) in the kernels' layout: int8_pack's tiles and the
    scales by tile [tiles, groups, 32] (and [tiles, supers, 32]; int8_group_linear, decode_linear.cpp)."""
    tiles = -(-q.shape[0] // 32)

    def by_tile(per_row: torch.Tensor) -> torch.Tensor:
        n, groups = per_row.shape
        return F.pad(per_row, (0, 0, 0, tiles * 32 - n)).view(tiles, 32, groups).transpose(1, 2).contiguous()

    return cpu_kernels.int8_pack(q.contiguous()), by_tile(scale), None if super_scale is None else by_tile(super_scale)


def int8_group_linear_call(quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int], out_features: int) -> KernelLinear:
    """linear_call (x, bias) of an int8 weight with group scales held as (*int8_group_tiles, group_size)."""

    def general(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quantized_linear(x, bias, lambda rows: cpu_kernels.int8_group_linear(rows, *quantized, out_features, bias),
                                lambda dtype, _: cpu_kernels.int8_group_dequantize(*quantized, out_features, dtype))

    return KernelLinear(torch.ops.tokenmill_cpu.int8_group_linear.default, (*quantized, out_features), general)


def _int4_rows(quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], out_features: int, any_rows_dtypes: tuple[torch.dtype, ...],
               kernel: Callable, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    def dequantized(dtype: torch.dtype, with_kernels: bool) -> torch.Tensor:
        if with_kernels:
            return cpu_kernels.int4_dequantize(*quantized, out_features, dtype)
        return quant_utils.dequantize_int4(*quantized).to(dtype)

    max_rows = x.numel() if x.dtype in any_rows_dtypes else KERNEL_MAX_ROWS  # x.numel(): at least its rows, so all of them
    return quantized_linear(x, bias, lambda rows: kernel(rows, *quantized, out_features, bias), dequantized, max_rows)


class LinearCallMethod(LinearMethodBase):
    """A method whose layers compute through the linear_call (x, bias) that store_int8 / store_int4 set on
    them: apply, the decode program's bound call and its kernel op all come from it."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.linear_call(x, bias)

    def bound_apply(self, layer: nn.Module, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        return bound_linear_call(layer.linear_call, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        return linear_call_kernel(layer.linear_call, bias, dtype)


class Int8LinearMethod(LinearCallMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        layer.weight = float_weight_to_quantize((sum(output_sizes), input_size), weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _store_int8(layer)
        free_parameter(layer.weight)


class Int4LinearMethod(LinearCallMethod):
    """Group-wise int4. A layer whose input size is no multiple of 32 (the packed block) is int8."""

    def __init__(self, group_size: int, symmetric: bool) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.as_int8 = False

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        layer.weight = float_weight_to_quantize((sum(output_sizes), input_size), weight_loader)
        self.as_int8 = input_size % quant_utils.INT4_BLOCK != 0
        if self.as_int8:
            logger.info("%s: %d input features are no multiple of %d; this layer is int8", getattr(layer, "prefix", "a layer"),
                        input_size, quant_utils.INT4_BLOCK)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.as_int8:
            _store_int8(layer)
        else:
            store_int4(layer, *quant_utils.quantize_int4(layer.weight.data, self.group_size, self.symmetric), self.group_size)
        free_parameter(layer.weight)


class Int8LMHeadMethod(UnquantizedEmbeddingMethod):
    """An LM head (or the embedding it is tied to) whose logits matmul reads an int8 copy.

    The float weight stays: a tied input embedding gathers its rows."""

    def __init__(self) -> None:
        super().__init__(prepack=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _store_int8(layer)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return int8_linear(layer, hidden, None)


@dataclass
class WeightOnlyConfig(QuantizationConfig):
    """`int8` or `int4` weight-only quantization of every linear layer and the LM head."""

    bits: int = 8
    group_size: int = 128  # int4 only: input channels per scale
    symmetric: bool = False  # int4 only: zero stays exact; asymmetric groups use all 16 levels

    def __post_init__(self) -> None:
        self.name = f"int{self.bits}"
        if self.bits not in (4, 8):
            raise ValueError(f"weight-only quantization has 4 or 8 bits, got {self.bits}")
        if self.bits == 4 and (self.group_size <= 0 or self.group_size % quant_utils.INT4_BLOCK):
            raise ValueError(f"int4 group_size must be a positive multiple of {quant_utils.INT4_BLOCK} (32, 64, 128...), got {self.group_size}")

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return Int4LinearMethod(self.group_size, self.symmetric) if self.bits == 4 else Int8LinearMethod()

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return Int8LMHeadMethod() if is_lm_head(prefix) else UnquantizedEmbeddingMethod(prepack=False)
