"""`w8a8`: INT8 weights per output channel x INT8 activations per token, both symmetric, with
dynamic activation scales (vLLM's W8A8 dynamic-per-token INT8, SmoothQuant's scheme without the
smoothing scales).

Weights are quantized at load from any float checkpoint, as `int8` does (scale = absmax / 127 per
output channel), and repacked once for the GEMM. Each call quantizes its rows of x (scale = absmax
/ 127 per row), multiplies int8 by int8 into int32, and rescales:
    y = float(acc) * w_scale[n] * x_scale[m] + bias[n],  in float32, rounded once to x's dtype.
On CPU the whole of it is one C++ op (kernels/cpu/int8_gemm.cpp: AVX512-VNNI, AVX512BW or AVX2
integer dot products, scalar otherwise), which gives the same bits as the PyTorch reference below.

Every row count takes that one path, single-request decode (1 to 8 rows) included: there the
int8 x int8 kernel measured faster than the `int8` method's W8A16 decode kernel on the same
weights (all of SmolLM2-135M's layers, weights read from memory: 1.35x at one row, 3.7x at
eight; more where they sit in cache, benchmarks/int8_gemm.py), so there is nothing to gain from
switching.

The LM head stays in the model dtype (as vLLM leaves it for W8A8 checkpoints): quantizing the
logits' input per token costs the most accuracy of any layer, and the unquantized head is already
a prepacked oneDNN GEMM on CPUs (float32, or bf16 with native bf16). The input embedding only gathers rows.

Not done: the activation quantize fused into the RMSNorm before the layer (the quantize is one
pass over x inside the GEMM op, small next to the multiply), and SmoothQuant scales from a
checkpoint. One scale per token costs SmolLM2-135M +8% perplexity (outlier channels; README).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization import quant_utils
from tokenmill.layers.quantization.base import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    WeightLoader,
    as_rows,
    float_weight_to_quantize,
    free_parameter,
)
from tokenmill.layers.quantization.unquantized import UnquantizedEmbeddingMethod, is_lm_head


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x [M, K]: (q int8 [M, K] in -127..127, scale float32 [M]), what the
    kernel's quantize computes, bit for bit (a zero row gets the smallest normal scale and zeros)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                          acc_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What the W8A8 kernel computes, in plain PyTorch: the integer products summed in acc_dtype
    (float64: exact; float32: exact while |sum| < 2^24), then the kernel's float32 epilogue."""
    qx, x_scale = quantize_per_token(x)
    acc = (qx.to(acc_dtype) @ qweight.to(acc_dtype).t()).float()
    y = acc * w_scale[None, :] * x_scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def store_w8a8(layer: nn.Module, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """The layer's int8 weight [N, K] (-127..127) and per-channel scale [N], as the GEMM reads them."""
    layer.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
    if qweight.device.type == "cpu" and cpu_kernels.cpu_kernels_available():
        packed, colsum = cpu_kernels.w8a8_pack(qweight.contiguous())
        layer.register_buffer("packed_weight", packed, persistent=False)
        layer.register_buffer("weight_colsum", colsum, persistent=False)
    else:  # no C++ kernels here: the PyTorch path reads the plain int8 weight
        layer.register_buffer("qweight", qweight.contiguous(), persistent=False)


class W8A8LinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        layer.weight = float_weight_to_quantize((sum(output_sizes), input_size), weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        store_w8a8(layer, *quant_utils.quantize_int8(layer.weight.data))
        free_parameter(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = as_rows(x)
        if hasattr(layer, "packed_weight"):
            y = cpu_kernels.w8a8_linear(flat, layer.packed_weight, layer.weight_colsum, layer.weight_scale, bias)
        else:  # float32 sums: exact for any realistic layer, and much faster than float64
            y = w8a8_linear_reference(flat, layer.qweight, layer.weight_scale, bias, acc_dtype=torch.float32)
        return y.view(*x.shape[:-1], y.shape[-1])


@dataclass
class W8A8Config(QuantizationConfig):
    """`w8a8` for every linear layer; the LM head and the embedding stay in the model dtype."""

    prepack_lm_head: bool = False  # the head's float weight prepacked for oneDNN (float32, or bf16 with native bf16)

    def __post_init__(self) -> None:
        self.name = "w8a8"

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return W8A8LinearMethod()

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return UnquantizedEmbeddingMethod(self.prepack_lm_head and is_lm_head(prefix))
