"""`awq`: AWQ checkpoints (AutoAWQ / llm-awq's GEMM layout, `quant_method: "awq"` in config.json).

A layer holds (K input, N output channels, G = K / group_size groups):
  qweight [K, N / 8] int32  4-bit integers packed along the output axis, in AutoAWQ's order:
                            slot i of an int32 (bits [4i, 4i + 4)) holds channel [0, 2, 4, 6, 1, 3, 5, 7][i]
                            of its run of eight
  qzeros  [G, N / 8] int32  the zero points, packed the same way
  scales  [G, N] float16
W[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n] (no zero-point offset,
no act-order). Each layer is unpacked, transposed and repacked once after loading, onto the `int4`
kernels (min = -zero * scale). Only the GEMM layout (`version: "gemm"`) with zero points is loaded;
`modules_to_not_convert` layers, the LM head and the embedding stay in float.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers.quantization.base import LinearMethodBase, WeightLoader
from tokenmill.layers.quantization.prequantized import (
    PackedInt4Method,
    PrequantizedConfig,
    checkpoint_param,
    remove_checkpoint_params,
    unpack_int32,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARAMS = ("qweight", "qzeros", "scales")


class AWQConfig(PrequantizedConfig):
    name = "awq"

    def __init__(self, quant: dict[str, Any], device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(device, dtype)
        # AutoAWQ writes w_bit / q_group_size in its own quant_config.json; transformers' config.json has bits / group_size.
        self.bits = int(quant.get("bits", quant.get("w_bit", 4)))
        self.group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
        self.zero_point = bool(quant.get("zero_point", True))
        version = str(quant.get("version", "gemm")).lower()
        problems = []
        if self.bits != 4:
            problems.append(f"{self.bits}-bit")
        if self.group_size <= 0 or self.group_size % 32:
            problems.append(f"group_size {self.group_size}")
        if not self.zero_point:
            problems.append("zero_point false")
        if version != "gemm":
            problems.append(f"version {version!r}")
        if problems:
            raise ValueError(f"this AWQ checkpoint has {'; '.join(problems)}: tokenmill loads AWQ 4-bit, GEMM layout "
                             "(version gemm), with zero points, group_size a multiple of 32 (128 typical)")
        self.modules_not_quantized = tuple(quant.get("modules_to_not_convert") or ())

    def quantized_method(self, prefix: str) -> LinearMethodBase | None:
        if self.not_quantized(prefix, self.modules_not_quantized):
            return None
        return AWQLinearMethod(self.group_size)


class AWQLinearMethod(PackedInt4Method):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        self.check_layer(layer, input_size, self.group_size, "AWQ")
        n, groups = sum(output_sizes), -(-input_size // self.group_size)
        layer.qweight = checkpoint_param((input_size, n // 8), torch.int32, weight_loader, output_dim=1, output_pack=8,
                                         input_dim=0)
        layer.qzeros = checkpoint_param((groups, n // 8), torch.int32, weight_loader, output_dim=1, output_pack=8,
                                        input_dim=0, input_pack=self.group_size)
        layer.scales = checkpoint_param((groups, n), torch.float32, weight_loader, output_dim=1, input_dim=0,
                                        input_pack=self.group_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER).t()  # [N, K]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER).t()  # [N, G]
        scale = layer.scales.data.t()
        remove_checkpoint_params(layer, _PARAMS)
        self.store(layer, q, zeros, scale)
