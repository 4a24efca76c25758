"""Weight-only quantization of float weights at load, and the plain PyTorch reference of the formats.

The formats are the ones kernels/cpu/decode_linear.cpp packs (int8_pack, int4_pack) and computes with:
  int8: q [N, K] int8 in -127..127, scale [N] float32 (per output channel, symmetric): W = q * scale.
  int4: packed [N, K / 2] uint8, scale and min [N, groups] float32, groups of `group_size` input
        channels (the last may be shorter, a multiple of 32): W = q * scale + min, q in 0..15.
        Quantized here, scale and min are values of fp16 (held in float32), so the kernels keep
        them in fp16 (half the bytes of float32 scales, the same weights).
        In each block of 32 weights (16 bytes) byte j holds weight j in its low nibble and weight
        j + 16 in its high one, so the kernel widens a vector of bytes to two vectors of
        consecutive weights. Symmetric groups store q = round(W / scale) + 8 with min = -8 * scale
        (zero is exact); asymmetric ones map [min, max] of the group onto 0..15.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_BLOCK = 32  # weights per 16-byte block of the packed int4 layout
ACTIVATION_BLOCK = 32  # input features per int8 scale of activations quantized at run time (int4_linear_a8)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight of an int8 one."""
    return q.float() * scale[:, None]


def int4_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, groups, group_size], the last group padded with copies of its first value
    (so the padding changes neither its min nor its max)."""
    n, k = w.shape
    pad = int4_groups(k, group_size) * group_size - k
    if pad:
        last = w[:, (k // group_size) * group_size:]
        w = torch.cat([w, last[:, :1].expand(n, pad)], dim=1)
    return w.view(n, -1, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int4: (packed [N, K / 2] uint8, scale [N, groups], min [N, groups] float32)."""
    n, k = weight.shape
    if k % INT4_BLOCK or group_size % INT4_BLOCK:
        raise ValueError(f"int4 needs in_features and group_size divisible by {INT4_BLOCK}, got {k} and {group_size}")
    groups = _grouped(weight.float(), group_size)
    tiny = 2.0**-24  # fp16's smallest step: a scale rounded to fp16 never becomes 0
    fp16 = lambda t: t.clamp(-65504.0, 65504.0).half().float()  # noqa: E731
    if symmetric:
        scale = fp16((groups.abs().amax(dim=-1) / 7.0).clamp(min=tiny))
        q = torch.round(groups / scale[..., None]).clamp_(-8, 7) + 8
        minimum = -8.0 * scale
    else:
        lo, hi = fp16(groups.amin(dim=-1)), groups.amax(dim=-1)
        scale = fp16(((hi - lo) / 15.0).clamp(min=tiny))
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        minimum = lo
    q = q.reshape(n, -1)[:, :k].to(torch.uint8)
    return pack_int4(q), scale.contiguous(), minimum.contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 2] bytes in the block layout above."""
    n, k = q.shape
    blocks = q.view(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] bytes -> [N, K] values 0..15."""
    n, half = packed.shape
    blocks = packed.view(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, 2 * half)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight of a packed int4 one."""
    q = unpack_int4(packed).float()
    n, k = q.shape
    expand = lambda t: t.repeat_interleave(group_size, dim=1)[:, :k]  # noqa: E731
    return q * expand(scale) + expand(minimum)


def _float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 inside, rounded once to x's dtype: what the kernels compute."""
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the int8 kernel computes, in plain PyTorch."""
    return _float32_linear(x, dequantize_int8(q, scale), bias)


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """What the int4 kernel computes, in plain PyTorch."""
    return _float32_linear(x, dequantize_int4(packed, scale, minimum, group_size), bias)


def quantize_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of ACTIVATION_BLOCK) quantized per row and block of 32 features as
    int4_linear_a8 and llama.cpp's Q8_0 do, dx = absmax / 127, q = round(x * (1 / dx)): the float32
    values q * dx it stands for."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).view(rows, k)


def int4_linear_a8_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """What int4_linear_a8 computes, in plain PyTorch: the int4 weight against x quantized to int8
    (quantize_activations_int8), its mins included."""
    y = F.linear(quantize_activations_int8(x), dequantize_int4(packed, scale, minimum, group_size), None if bias is None else bias.float())
    return y.to(x.dtype)
