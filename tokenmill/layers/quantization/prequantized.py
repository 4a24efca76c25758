"""What the pre-quantized checkpoint formats (GPTQ, AWQ, compressed-tensors) share.

A layer of such a checkpoint holds its integers packed in int32s, its scales and zero points by
group, in the format's own layout. The methods here create parameters in exactly that layout (each
saying which axis holds output and input channels, and how many channels one element holds, so
fused and tensor-parallel layers load shard by shard as float ones do), and after loading convert
them, once, into the layout the existing kernels compute with:
  4-bit  -> `int4` (quant_utils' packed blocks, W = q * scale + min with min = -zero * scale),
  8-bit  -> `int8` per output channel (symmetric), or `w8a8` when activations are int8 too.
Nothing is dequantized to float and requantized: the integers and scales are the checkpoint's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.quantization import quant_utils
from tokenmill.layers.quantization.base import EmbeddingMethodBase, KernelCall, LinearMethodBase, QuantizationConfig, WeightLoader
from tokenmill.layers.quantization.unquantized import UnquantizedConfig
from tokenmill.layers.quantization.weight_only import Int4LinearMethod, int8_linear, store_int4, store_int8

logger = logging.getLogger(__name__)

# The checkpoint's names of the projections tokenmill fuses into one layer (its prefixes end in the key).
FUSED_CHECKPOINT_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(prefix: str) -> list[str]:
    """The checkpoint's module names a layer loads from: its own, or those of the projections it fuses."""
    head, _, last = prefix.rpartition(".")
    shards = FUSED_CHECKPOINT_NAMES.get(last)
    if shards is None:
        return [prefix]
    return [f"{head}.{s}" if head else s for s in shards]


def checkpoint_param(shape: tuple[int, ...], dtype: torch.dtype, weight_loader: WeightLoader, *, output_dim: int | None,
                     input_dim: int | None, output_pack: int = 1, input_pack: int = 1) -> nn.Parameter:
    """A parameter in the checkpoint's layout. output_dim / input_dim: the axes of output and input
    channels (None: shared along it); *_pack: channels per element along that axis (see layers/linear.py)."""
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.output_pack = output_pack
    param.input_pack = input_pack
    return param


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Iterable[int] | None = None) -> torch.Tensor:
    """The values (0 .. 2^bits - 1, int32) packed 32 / bits to an int32 along dim, value i of an int32 in
    its bits [bits * i, bits * (i + 1)). order: the channel each slot holds, within an int32's run of
    channels (AWQ's [0, 2, 4, 6, 1, 3, 5, 7]); by default slot i holds channel i."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.to(torch.int32).movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., elements, per]
    if order is not None:
        slot_of_channel = torch.argsort(torch.tensor(list(order), device=packed.device))
        values = values.index_select(-1, slot_of_channel)
    return values.flatten(-2).movedim(-1, dim)


def remove_checkpoint_params(layer: nn.Module, names: Iterable[str]) -> None:
    for name in names:
        if name in layer._parameters:
            delattr(layer, name)


def input_order(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor | None:
    """Act-order (desc_act): g_idx[k] is input channel k's group. The permutation that puts each group's
    channels side by side (None when they already are); every group must have group_size channels
    (the last may be shorter), as GPTQ writes them."""
    k = g_idx.numel()
    expected = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.to(expected.dtype), expected):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm].to(expected.dtype), expected):
        raise ModelLoadError(f"{what}: g_idx does not give every group {group_size} input channels; "
                             "tokenmill reorders act-order checkpoints whose groups are whole")
    return perm


def g_idx_param(layer: nn.Module, input_size: int, weight_loader: WeightLoader) -> nn.Parameter:
    """An act-order checkpoint's g_idx [K] (input channel k's group), -1 until loaded; optional (a checkpoint
    without act-order may lack it). Every projection of a fused layer brings its own: one input order
    serves them all only if they agree (they do as GPTQ writes them: the projections share their input,
    so their Hessians' orders)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        before = param.data.clone()
        weight_loader(param, loaded, shard_id)
        if before[0] >= 0 and not torch.equal(before, param.data):
            raise ModelLoadError(f"{layer.prefix}: the fused projections' g_idx differ; tokenmill needs one input "
                                 "order per fused layer")

    param = checkpoint_param((input_size,), torch.int32, load, output_dim=None, input_dim=0)
    param.data.fill_(-1)
    param.optional = True
    return param


def check_act_order_unsplit(layer: nn.Module, input_size: int) -> None:
    if input_size != getattr(layer, "full_input_size", input_size):
        raise ModelLoadError(f"{layer.prefix}: act-order layers cannot split their input over tensor-parallel ranks "
                             "(a rank's channels belong to any group); use tensor_parallel_size 1")


class PackedInt4Method(Int4LinearMethod):
    """A 4-bit checkpoint's layer on the `int4` kernels. Subclasses create the checkpoint's
    parameters and call `store` with the unpacked integers after loading."""

    def __init__(self, group_size: int) -> None:
        super().__init__(group_size, symmetric=False)

    @staticmethod
    def check_layer(layer: nn.Module, input_size: int, group_size: int, method: str) -> None:
        if input_size % quant_utils.INT4_BLOCK or group_size % quant_utils.INT4_BLOCK:
            raise ModelLoadError(f"{layer.prefix}: {method} 4-bit layers run on the int4 kernels, which need input features and "
                                 f"group size in multiples of {quant_utils.INT4_BLOCK}; got {input_size} and {group_size}")

    def store(self, layer: nn.Module, q: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor,
              perm: torch.Tensor | None = None) -> None:
        """q [N, K] in 0..15, zeros and scale [N, groups]: W = (q - zero) * scale. perm: the input order
        of q's columns (act-order), or None. The checkpoint's parameters must be removed first."""
        scale = scale.float()
        store_int4(layer, quant_utils.pack_int4(q.to(torch.uint8).contiguous()), scale, -zeros.float() * scale, self.group_size)
        layer.register_buffer("input_perm", perm, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(layer, "input_perm", None) is not None:  # act-order: the weight's columns are in group order, so are x's
            x = x.index_select(-1, layer.input_perm)
        return super().apply(layer, x, bias)

    def bound_apply(self, layer: nn.Module, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        if getattr(layer, "input_perm", None) is not None:  # apply's permutation of x first
            return lambda x: self.apply(layer, x, bias)
        return super().bound_apply(layer, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        if getattr(layer, "input_perm", None) is not None:  # the permutation is a second op
            return None
        return super().decode_kernel(layer, bias, dtype)


class PackedInt8Method(LinearMethodBase):
    """An 8-bit checkpoint's layer, symmetric per output channel, on the `int8` kernels."""

    @staticmethod
    def store(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        """q [N, K] int8, scale [N]: W = q * scale."""
        store_int8(layer, q, scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(layer, x, bias)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' and vLLM's module patterns: `re:<regex>` (matched from the start), or a name
    that equals the module's or ends it after a dot."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


class PrequantizedConfig(QuantizationConfig):
    """Linear layers by the checkpoint's method; the ones it left in float (and the embedding and LM
    head) as unquantized layers. Subclasses say which layers are quantized and make their method."""

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        self.float_config = UnquantizedConfig(device, dtype)

    def quantized_method(self, prefix: str) -> LinearMethodBase | None:
        """The method of a quantized layer, None for a layer the checkpoint keeps in float."""
        raise NotImplementedError

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.quantized_method(prefix) or self.float_config.linear_method(prefix)

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return self.float_config.embedding_method(prefix)

    def not_quantized(self, prefix: str, modules: Iterable[str]) -> bool:
        """Whether a layer is in the checkpoint's float list (`modules`, names or substrings as the format
        has them); a fused layer's projections must agree."""
        names = checkpoint_names(prefix)
        flags = {any(m in n for m in modules) for n in names}
        if len(flags) > 1:
            raise ModelLoadError(f"{prefix}: the checkpoint quantizes some of {', '.join(names)} and not others; "
                                 "tokenmill fuses them into one layer, which has one format")
        return flags.pop()

