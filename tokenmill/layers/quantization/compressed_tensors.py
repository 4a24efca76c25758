"""`compressed-tensors`: checkpoints written by llm-compressor (`quant_method: "compressed-tensors"`).

config.json's `quantization_config` has `config_groups` (each a scheme: `targets`, `weights`,
`input_activations`), an `ignore` list and a `format`. A layer's scheme is the group whose targets
match it (`Linear`, a name, or `re:<regex>`), unless `ignore` lists it. Schemes loaded:
  W8A8  `int-quantized`: weights int8, symmetric, per channel (or per tensor); activations int8,
        symmetric, dynamic per token. Per layer: weight [N, K] int8, weight_scale [N, 1].
        Onto `w8a8` (weights at -128 are clamped to -127: the kernel's symmetric range).
  W8A16 the same weights, no input_activations: onto `int8`.
  W4A16 `pack-quantized`: weights 4-bit, per group (a multiple of 32) or per channel, symmetric or
        not. Per layer: weight_packed [N, K / 8] int32 (value i of an int32 in bits [4i, 4i + 4),
        stored as q + 8 for q in -8..7, compressed-tensors' `pack_to_int32`), weight_scale [N, G],
        weight_zero_point [N / 8, G] int32 (asymmetric only; packed the same way, along the output
        axis), weight_shape [2]. W = (q - zero) * scale. Onto `int4`.
W4A16 with group act-order (`actorder: "group"`) also has weight_g_idx [K], and is reordered at load as
GPTQ's act-order is. Static activation scales, asymmetric activations, float (fp8) and other bit
widths and sparse formats are refused by name. The LM head and the embedding stay float.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.quantization.base import EmbeddingMethodBase, KernelCall, LinearMethodBase, QuantizedInput, WeightLoader
from tokenmill.layers.quantization.prequantized import (
    PackedInt4Method,
    PackedInt8Method,
    PrequantizedConfig,
    check_act_order_unsplit,
    checkpoint_names,
    checkpoint_param,
    g_idx_param,
    input_order,
    matches,
    remove_checkpoint_params,
    unpack_int32,
)
from tokenmill.layers.quantization.unquantized import is_lm_head
from tokenmill.layers.quantization.w8a8 import W8A8LinearMethod, store_w8a8

logger = logging.getLogger(__name__)

_SUPPORTED = ("W8A8 (int-quantized: int8 weights symmetric per channel, int8 activations symmetric dynamic per token), "
              "W8A16 (int8 weights symmetric per channel) and W4A16 (pack-quantized: 4-bit weights per group of a multiple "
              "of 32 or per channel)")


def _scheme_problems(scheme: dict[str, Any], fmt: str) -> list[str]:
    weights = scheme.get("weights") or {}
    acts = scheme.get("input_activations")
    bits, kind = int(weights.get("num_bits", 0)), str(weights.get("type", "int"))
    strategy, group = weights.get("strategy"), weights.get("group_size")
    problems = []
    if kind != "int" or bits not in (4, 8):
        problems.append(f"{kind} {bits}-bit weights")
    elif bits == 8 and not weights.get("symmetric", True):
        problems.append("asymmetric 8-bit weights")
    elif bits == 8 and strategy not in ("channel", "tensor"):
        problems.append(f"8-bit weights by {strategy}")
    elif bits == 8 and fmt not in ("int-quantized", "naive-quantized"):
        problems.append(f"8-bit weights in format {fmt!r}")
    elif bits == 4 and (fmt != "pack-quantized" or strategy not in ("group", "channel")):
        problems.append(f"4-bit weights by {strategy} in format {fmt!r}")
    elif bits == 4 and strategy == "group" and (not group or int(group) % 32):
        problems.append(f"group_size {group}")
    if weights.get("actorder") == "group" and (bits != 4 or strategy != "group"):
        problems.append("group act-order without 4-bit groups")
    if weights.get("dynamic"):
        problems.append("dynamic weights")
    if acts is not None:
        if bits != 8:
            problems.append(f"{bits}-bit weights with quantized activations")
        elif str(acts.get("type", "int")) != "int" or int(acts.get("num_bits", 0)) != 8:
            problems.append("non-int8 activations")
        elif not acts.get("symmetric", True):
            problems.append("asymmetric activations")
        elif not acts.get("dynamic", False) or acts.get("strategy") not in ("token", None):
            problems.append(f"static or per-{acts.get('strategy')} activation scales")
    if scheme.get("output_activations") is not None:
        problems.append("quantized outputs")
    return problems


class CompressedTensorsConfig(PrequantizedConfig):
    name = "compressed-tensors"

    def __init__(self, quant: dict[str, Any], device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(device, dtype)
        fmt = str(quant.get("format") or "dense")
        self.groups: list[tuple[list[str], dict[str, Any]]] = []
        problems = []
        status = quant.get("quantization_status", "compressed")
        if status != "compressed":
            problems.append(f"quantization_status {status!r} (weights not compressed)")
        sparsity = quant.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            problems.append(f"sparsity format {sparsity.get('format')!r}")
        if quant.get("kv_cache_scheme"):
            problems.append("a kv_cache_scheme")
        for name, scheme in (quant.get("config_groups") or {}).items():
            scheme_problems = _scheme_problems(scheme, str(scheme.get("format") or fmt))
            problems += [f"{name}: {p}" for p in scheme_problems]
            self.groups.append((list(scheme.get("targets") or []), {**scheme, "format": scheme.get("format") or fmt}))
        if not self.groups:
            problems.append("no config_groups")
        if problems:
            raise ValueError(f"this compressed-tensors checkpoint has {'; '.join(problems)}: tokenmill loads {_SUPPORTED}")
        self.ignore = list(quant.get("ignore") or [])

    def scheme(self, name: str) -> dict[str, Any] | None:
        """The scheme of a checkpoint module, None when it stays float."""
        if matches(name, self.ignore):
            return None
        for targets, scheme in self.groups:
            if "Linear" in targets or matches(name, [t for t in targets if t != "Linear"]):
                return scheme
        return None

    def quantized_method(self, prefix: str) -> LinearMethodBase | None:
        names = checkpoint_names(prefix)
        schemes = [self.scheme(n) for n in names]
        if any(s is not schemes[0] for s in schemes):
            raise ModelLoadError(f"{prefix}: the checkpoint quantizes {', '.join(names)} differently; tokenmill fuses them "
                                 "into one layer, which has one format")
        scheme = schemes[0]
        if scheme is None:
            return None
        weights = scheme["weights"]
        if int(weights["num_bits"]) == 4:
            group = int(weights["group_size"]) if weights.get("strategy") == "group" else -1
            return CTPackedInt4Method(group, not weights.get("symmetric", True), weights.get("actorder") == "group")
        return CTInt8Method(activations=scheme.get("input_activations") is not None)

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        if is_lm_head(prefix) and self.scheme(prefix) is not None:
            raise ModelLoadError("this compressed-tensors checkpoint quantizes the LM head; tokenmill keeps the LM head in float "
                                 "(add lm_head to the quantization's ignore list)")
        return super().embedding_method(prefix)


def _tensor_scale_loader(layer: nn.Module, weight_loader: WeightLoader) -> WeightLoader:
    """A per-tensor scale (one value per checkpoint projection) as one per output channel of its shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() == 1:
            full = layer.full_output_sizes
            rows = sum(full) if shard_id is None else full[layer.shard_index(shard_id)]
            loaded = loaded.reshape(1, 1).expand(rows, 1)
        weight_loader(param, loaded.reshape(-1, 1), shard_id)

    return load


def _shape_loader(layer: nn.Module) -> WeightLoader:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if int(loaded[1]) != layer.full_input_size:
            raise ModelLoadError(f"{layer.prefix}: weight_shape says {int(loaded[1])} input features, expected {layer.full_input_size}")

    return load


class CTInt8Method(LinearMethodBase):
    """8-bit symmetric weights per channel: `w8a8` when activations are quantized too, else `int8`."""

    def __init__(self, activations: bool) -> None:
        self.activations = activations
        # The checkpoint's scheme: one activation scale per token (the only one _check_scheme accepts).
        self.compute = W8A8LinearMethod(activation_group_size=0) if activations else PackedInt8Method()

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        n = sum(output_sizes)
        layer.weight = checkpoint_param((n, input_size), torch.int8, weight_loader, output_dim=0, input_dim=1)
        layer.weight_scale = checkpoint_param((n, 1), torch.float32, _tensor_scale_loader(layer, weight_loader), output_dim=0,
                                              input_dim=None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = layer.weight.data, layer.weight_scale.data.reshape(-1)
        remove_checkpoint_params(layer, ("weight", "weight_scale"))
        if not self.activations:
            PackedInt8Method.store(layer, q, scale)
            return
        clamped = int((q == -128).sum())
        if clamped:  # llm-compressor's symmetric range reaches -128; the int8 x int8 kernel's is -127..127
            logger.info("%s: %d weights at -128 clamped to -127 (the W8A8 kernel's symmetric range)", layer.prefix, clamped)
            q = q.clamp(min=-127)
        store_w8a8(layer, q, scale, group_size=0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.compute.apply(layer, x, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        return self.compute.decode_kernel(layer, bias, dtype)

    def quantized_input(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantizedInput | None:
        return self.compute.quantized_input(layer, bias, dtype)


class CTPackedInt4Method(PackedInt4Method):
    """4-bit weights packed along the input, by group (or channel: group -1), symmetric or not."""

    def __init__(self, group_size: int, asymmetric: bool, act_order: bool = False) -> None:
        super().__init__(group_size)
        self.per_channel = group_size == -1
        self.asymmetric = asymmetric
        self.act_order = act_order  # weight_g_idx: groups in activation order, reordered at load as GPTQ's

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        if self.per_channel:
            self.group_size = input_size
        self.check_layer(layer, input_size, self.group_size, "compressed-tensors")
        n, groups = sum(output_sizes), -(-input_size // self.group_size)
        group_dim = None if self.per_channel else 1
        layer.weight_packed = checkpoint_param((n, input_size // 8), torch.int32, weight_loader, output_dim=0, input_dim=1,
                                               input_pack=8)
        layer.weight_scale = checkpoint_param((n, groups), torch.float32, weight_loader, output_dim=0, input_dim=group_dim,
                                              input_pack=self.group_size)
        layer.weight_shape = checkpoint_param((2,), torch.int64, _shape_loader(layer), output_dim=None, input_dim=None)
        if self.act_order:
            check_act_order_unsplit(layer, input_size)
            layer.weight_g_idx = g_idx_param(layer, input_size, weight_loader)
        if self.asymmetric:
            layer.weight_zero_point = checkpoint_param((n // 8, groups), torch.int32, weight_loader, output_dim=0, output_pack=8,
                                                       input_dim=group_dim, input_pack=self.group_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.weight_packed.data, 4, dim=1)  # [N, K], q + 8
        scale = layer.weight_scale.data
        zeros = unpack_int32(layer.weight_zero_point.data, 4, dim=0) if self.asymmetric else torch.full_like(scale, 8)
        perm = None
        if self.act_order:
            g_idx = layer.weight_g_idx.data
            if g_idx[0] < 0:
                raise ModelLoadError(f"{layer.prefix}: the checkpoint is group act-order but has no weight_g_idx")
            perm = input_order(g_idx, self.group_size, layer.prefix)
            if perm is not None:
                q = q.index_select(1, perm)
        remove_checkpoint_params(layer, ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"))
        self.store(layer, q, zeros, scale, perm)
