"""`gptq`: GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: "gptq"` in config.json).

A layer holds (K input, N output channels, G = ceil(K / group_size) groups, 32 / bits values per int32):
  qweight [K * bits / 32, N] int32  the integers, packed along the input axis, value i of an int32
                                    in its bits [bits * i, bits * (i + 1)) (AutoGPTQ's `pack`)
  qzeros  [G, N * bits / 32] int32  the zero points, packed the same way along the output axis
  scales  [G, N] float16
  g_idx   [K] int32                 input channel k's group (act-order / desc_act: a permutation of
                                    k // group_size; otherwise that itself)
W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]. The classic format (checkpoint_format
"gptq", the default) stores each zero point minus one, so a zero point reads back as stored + 1 (16
for a stored 15, as AutoGPTQ's and vLLM's kernels read it); "gptq_v2" stores it as is.

4-bit layers run on the `int4` kernels: unpacked, transposed and repacked once after loading, with
min = -zero * scale per group. Act-order layers have their input channels reordered so each group's
channels lie side by side, and each call gathers x's columns in that order. 8-bit layers run on the
`int8` kernels when they are symmetric per output channel (group_size -1, every zero point 128);
group-wise 8-bit has no kernel here and is refused. The LM head and the embedding stay in float.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.quantization.base import LinearMethodBase, WeightLoader
from tokenmill.layers.quantization.prequantized import (
    PackedInt4Method,
    PackedInt8Method,
    PrequantizedConfig,
    check_act_order_unsplit,
    checkpoint_param,
    g_idx_param,
    input_order,
    remove_checkpoint_params,
    unpack_int32,
)

_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
_SUPPORTED = "4-bit with group_size 32, 64, 128... (a multiple of 32) or -1, act-order or not; 8-bit symmetric with group_size -1"


class GPTQConfig(PrequantizedConfig):
    name = "gptq"

    def __init__(self, quant: dict[str, Any], device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(device, dtype)
        self.bits = int(quant.get("bits", 4))
        self.group_size = int(quant.get("group_size", 128))
        self.desc_act = bool(quant.get("desc_act", False))
        self.sym = bool(quant.get("sym", True))
        self.checkpoint_format = str(quant.get("checkpoint_format") or "gptq").lower()
        problems = []
        if self.bits not in (4, 8):
            problems.append(f"{self.bits}-bit")
        elif self.bits == 4 and self.group_size != -1 and (self.group_size <= 0 or self.group_size % 32):
            problems.append(f"group_size {self.group_size}")
        elif self.bits == 8 and (self.group_size != -1 or not self.sym or self.desc_act):
            problems.append(f"8-bit with group_size {self.group_size}, sym {self.sym}, desc_act {self.desc_act}")
        if self.checkpoint_format not in ("gptq", "gptq_v2"):
            problems.append(f"checkpoint_format {self.checkpoint_format!r} (supported: gptq, gptq_v2)")
        if quant.get("lm_head"):
            problems.append("a quantized lm_head")
        if quant.get("dynamic"):
            problems.append("per-module `dynamic` overrides")
        if problems:
            raise ValueError(f"this GPTQ checkpoint has {'; '.join(problems)}: tokenmill loads GPTQ {_SUPPORTED}")
        self.modules_not_quantized = tuple(quant.get("modules_to_not_convert") or ())

    def quantized_method(self, prefix: str) -> LinearMethodBase | None:
        if self.not_quantized(prefix, self.modules_not_quantized):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod(PackedInt4Method):
    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(config.group_size)
        self.config = config
        self.as_int8 = config.bits == 8

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        config = self.config
        pack = 32 // config.bits
        per_channel = config.group_size == -1
        # group_size -1: one group over the layer's whole input (then a row-parallel rank's slice is one group too).
        self.group_size = input_size if per_channel else config.group_size
        if config.bits == 4:
            self.check_layer(layer, input_size, self.group_size, "GPTQ")
        if config.desc_act:
            check_act_order_unsplit(layer, input_size)
        n, groups = sum(output_sizes), -(-input_size // self.group_size)
        group_dim = None if per_channel else 0  # per channel: one row of scales every rank keeps whole
        layer.qweight = checkpoint_param((input_size // pack, n), torch.int32, weight_loader, output_dim=1, input_dim=0,
                                         input_pack=pack)
        layer.qzeros = checkpoint_param((groups, n // pack), torch.int32, weight_loader, output_dim=1, output_pack=pack,
                                        input_dim=group_dim, input_pack=self.group_size)
        layer.scales = checkpoint_param((groups, n), torch.float32, weight_loader, output_dim=1, input_dim=group_dim,
                                        input_pack=self.group_size)
        layer.g_idx = g_idx_param(layer, input_size, weight_loader)  # older checkpoints have none

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        config = self.config
        q = unpack_int32(layer.qweight.data, config.bits, dim=0).t()  # [N, K]
        zeros = unpack_int32(layer.qzeros.data, config.bits, dim=1).t()  # [N, G]
        if config.checkpoint_format == "gptq":
            zeros = zeros + 1
        scale = layer.scales.data.t()
        g_idx = layer.g_idx.data
        perm = None
        if config.desc_act:
            if g_idx[0] < 0:
                raise ModelLoadError(f"{layer.prefix}: the checkpoint is act-order (desc_act) but has no g_idx")
            perm = input_order(g_idx, self.group_size, layer.prefix)
        elif g_idx[0] >= 0 and input_order(g_idx - g_idx[0], self.group_size, layer.prefix) is not None:
            raise ModelLoadError(f"{layer.prefix}: g_idx is out of order but quantization_config says desc_act false")
        remove_checkpoint_params(layer, _PARAMS)
        if config.bits == 8:
            if not torch.all(zeros == 128):
                raise ModelLoadError(f"{layer.prefix}: 8-bit GPTQ runs symmetric (every zero point 128); this layer's are not")
            PackedInt8Method.store(layer, (q - 128).to(torch.int8), scale[:, 0])
            return
        if perm is not None:
            q = q.index_select(1, perm)
        self.store(layer, q, zeros, scale, perm)
