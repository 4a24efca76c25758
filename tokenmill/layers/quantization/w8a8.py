"""`w8a8`: INT8 weights per output channel x INT8 activations per token and group of 128 input
features, both symmetric, with dynamic activation scales (vLLM's W8A8 dynamic INT8 with its
per-token-group activation scales; `activation_group_size: 0` is one scale per token, vLLM's
dynamic-per-token, SmoothQuant's scheme without the smoothing scales).

Weights are quantized at load from any float checkpoint, as `int8` does (scale = absmax / 127 per
output channel), and repacked once for the GEMM. Each call quantizes its rows of x (scale = absmax
/ 127 per row and group), multiplies int8 by int8 into int32 per group, and rescales:
    s = sum over groups g of float(acc_g) * x_scale[m, g];  y = s * w_scale[n] + bias[n],
in float32 (in that order), rounded once to x's dtype.
Why groups: one scale per token leaves few levels to most of a row where a few channels are
outliers, as in SmolLM2-135M (+8% perplexity per token, +0.3% per group of 128; README).
On CPU the whole of it is one C++ op (kernels/cpu/int8_gemm.cpp: AVX512-VNNI, AVX512BW or AVX2
integer dot products, scalar otherwise), which gives the same bits as the PyTorch reference below.

Every row count takes that one path, single-request decode (1 to 8 rows) included: there the
int8 x int8 kernel measured faster than the `int8` method's W8A16 decode kernel on the same
weights (all of SmolLM2-135M's layers, weights read from memory: 1.35x at one row, 3.7x at
eight; more where they sit in cache, benchmarks/int8_gemm.py), so there is nothing to gain from
switching.

The LM head stays in the model dtype by default (as vLLM leaves it for W8A8 checkpoints): quantizing
the logits' input costs accuracy (SmolLM2: +0.4% perplexity more with groups of 128, README), and the
unquantized head is already a prepacked oneDNN GEMM on CPUs (float32, or bf16 with native bf16).
`quantize_lm_head: true` runs it through the w8a8 GEMM too, for speed where the head is a large
part of a step (a fifth of a 113M Llama's multiplies at 32 rows). The input embedding only gathers rows.

The activation quantize of qkv_proj and gate_up_proj is fused into the RMSNorm before them in decode
steps (PPL.LLM's design; QuantizedInput, used by models/llama.py's decode programs): one op normalizes
each row and quantizes it while it is in L1 (w8a8_rms_norm_quant), and the GEMM takes its int8 rows
(w8a8_linear_quantized), the same bits as the norm followed by w8a8_linear. Prompt chunks keep the two
ops (the quantize is one pass inside the GEMM op, small next to a prompt's multiply).

`smoothquant`: an act-scales file whose SmoothQuant factors are folded into the norms and weights at load,
before the weights are quantized (smoothquant.py); what it buys is accuracy, above all with one activation
scale per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.errors import ModelLoadError
from tokenmill.layers.quantization import quant_utils
from tokenmill.layers.quantization.base import (
    EmbeddingMethodBase,
    KernelCall,
    LinearMethodBase,
    QuantizationConfig,
    QuantizedInput,
    WeightLoader,
    as_rows,
    float_weight_to_quantize,
    free_parameter,
)
from tokenmill.layers.quantization.smoothquant import DEFAULT_ALPHA, load_act_scales, smooth_layers
from tokenmill.layers.quantization.unquantized import UnquantizedEmbeddingMethod, is_lm_head


ACTIVATION_GROUP_SIZE = 128  # input features per activation scale (0: one per token)


def activation_groups(in_features: int, group_size: int) -> list[tuple[int, int]]:
    """The [start, end) input features of each activation group (the last one may be shorter)."""
    size = group_size or in_features
    return [(k, min(in_features, k + size)) for k in range(0, in_features, size)]


def quantize_per_token_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of x [M, K] per row and group of group_size features (0: the whole row): (q int8
    [M, K] in -127..127, scale float32 [M, groups]), what the kernel's quantize computes, bit for bit
    (a zero group gets the smallest normal scale and zeros)."""
    xf = x.float()
    groups = activation_groups(x.shape[-1], group_size)
    scale = torch.stack([xf[:, a:b].abs().amax(dim=-1) for a, b in groups], dim=-1) / 127.0
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    per_feature = torch.cat([scale[:, g:g + 1].expand(-1, b - a) for g, (a, b) in enumerate(groups)], dim=-1)
    return torch.round(xf / per_feature).clamp_(-127, 127).to(torch.int8), scale


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                          group_size: int = ACTIVATION_GROUP_SIZE, acc_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What the W8A8 kernel computes, in plain PyTorch: each group's integer products summed in
    acc_dtype (float64: exact; float32: exact while |sum| < 2^24), then the kernel's float32 sums and
    epilogue, in its order."""
    qx, x_scale = quantize_per_token_group(x, group_size)
    total = torch.zeros(x.shape[0], qweight.shape[0])
    for g, (a, b) in enumerate(activation_groups(x.shape[-1], group_size)):
        acc = (qx[:, a:b].to(acc_dtype) @ qweight[:, a:b].to(acc_dtype).t()).float()
        total = total + acc * x_scale[:, g:g + 1]
    y = total * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def store_w8a8(layer: nn.Module, qweight: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    """The layer's int8 weight [N, K] (-127..127) and per-channel scale [N], as the GEMM reads them
    with activation groups of group_size (0: per token)."""
    layer.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
    if qweight.device.type == "cpu" and cpu_kernels.cpu_kernels_available():
        packed, colsum = cpu_kernels.w8a8_pack(qweight.contiguous(), group_size)
        layer.register_buffer("packed_weight", packed, persistent=False)
        layer.register_buffer("weight_colsum", colsum, persistent=False)
    else:  # no C++ kernels here: the PyTorch path reads the plain int8 weight
        layer.register_buffer("qweight", qweight.contiguous(), persistent=False)


class W8A8LinearMethod(LinearMethodBase):
    def __init__(self, activation_group_size: int) -> None:
        self.group_size = activation_group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        layer.weight = float_weight_to_quantize((sum(output_sizes), input_size), weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        store_w8a8(layer, *quant_utils.quantize_int8(layer.weight.data), self.group_size)
        free_parameter(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_apply(layer, x, bias, self.group_size)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        if not hasattr(layer, "packed_weight"):  # the PyTorch reference: no kernel op
            return None
        return KernelCall("tokenmill_cpu::w8a8_linear", (layer.packed_weight, layer.weight_colsum, layer.weight_scale, bias, self.group_size),
                          None)

    def quantized_input(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantizedInput | None:
        return w8a8_quantized_input(layer, bias, self.group_size, dtype)


def w8a8_quantized_input(layer: nn.Module, bias: torch.Tensor | None, group_size: int, dtype: torch.dtype) -> QuantizedInput | None:
    """The layer's GEMM on rows quantized by the norm before it (w8a8_rms_norm_quant), where it runs on the kernels."""
    if not hasattr(layer, "packed_weight"):
        return None
    args = (layer.packed_weight, layer.weight_colsum, layer.weight_scale, bias, group_size, dtype)
    gemm = torch.ops.tokenmill_cpu.w8a8_linear_quantized.default
    return QuantizedInput(group_size, lambda q, scales: gemm(q, scales, *args),
                          KernelCall("tokenmill_cpu::w8a8_linear_quantized", args, None))


def w8a8_apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """y = x W^T + b through what store_w8a8 kept: the kernel, or its PyTorch reference."""
    flat = as_rows(x)
    if hasattr(layer, "packed_weight"):
        y = cpu_kernels.w8a8_linear(flat, layer.packed_weight, layer.weight_colsum, layer.weight_scale, bias, group_size)
    else:  # float32 sums: exact for any realistic layer, and much faster than float64
        y = w8a8_linear_reference(flat, layer.qweight, layer.weight_scale, bias, group_size, acc_dtype=torch.float32)
    return y.view(*x.shape[:-1], y.shape[-1])


class W8A8LMHeadMethod(UnquantizedEmbeddingMethod):
    """An LM head whose logits come from the w8a8 GEMM on an int8 copy of its weight. The float weight
    stays: a tied input embedding gathers its rows."""

    def __init__(self, activation_group_size: int) -> None:
        super().__init__(prepack=False)
        self.group_size = activation_group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        store_w8a8(layer, *quant_utils.quantize_int8(layer.weight.data), self.group_size)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return w8a8_apply(layer, hidden, None, self.group_size)


@dataclass
class W8A8Config(QuantizationConfig):
    """`w8a8` for every linear layer (and the LM head with quantize_lm_head); the embedding stays in the model dtype."""

    prepack_lm_head: bool = False  # the head's float weight prepacked for oneDNN (float32, or bf16 with native bf16)
    activation_group_size: int = ACTIVATION_GROUP_SIZE  # input features per activation scale; 0: one per token
    quantize_lm_head: bool = False  # the LM head as w8a8 too (its float weight stays for the input embedding)
    smoothquant: str | None = None  # an act-scales file: SmoothQuant's factors folded in at load (smoothquant.py)
    smoothquant_alpha: float = DEFAULT_ALPHA  # how much of the activations' range moves into the weights

    def __post_init__(self) -> None:
        self.name = "w8a8"
        size = self.activation_group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size % 4:
            raise ValueError(f"w8a8: activation_group_size must be 0 (one scale per token) or a positive multiple of 4, got {size!r}")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"w8a8: quantize_lm_head must be true or false, got {self.quantize_lm_head!r}")
        if self.smoothquant is not None and not isinstance(self.smoothquant, str):
            raise ValueError(f"w8a8: smoothquant must be the path of an act-scales file, got {self.smoothquant!r}")
        alpha = self.smoothquant_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"w8a8: smoothquant_alpha must be a number in [0, 1], got {alpha!r}")

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return W8A8LinearMethod(self.activation_group_size)

    def process_model_after_loading(self, model: nn.Module) -> None:
        if self.smoothquant is None:
            return
        pairs = getattr(model, "smoothing_pairs", None)
        if pairs is None:
            raise ModelLoadError(f"w8a8: smoothquant folds into the Llama family's norms; {type(model).__name__} has no smoothing pairs")
        smooth_layers(pairs(), load_act_scales(self.smoothquant), float(self.smoothquant_alpha))

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        if self.quantize_lm_head and is_lm_head(prefix):
            return W8A8LMHeadMethod(self.activation_group_size)
        return UnquantizedEmbeddingMethod(self.prepack_lm_head and is_lm_head(prefix))
