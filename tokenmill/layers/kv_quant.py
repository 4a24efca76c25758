"""Quantized KV cache: what `kv_cache_dtype` stores, and the PyTorch reference of its quantize / dequantize.

vLLM's names:
  auto      the model's dtype (no quantization)
  int8      symmetric int8 with one float32 scale per (token, KV head): absmax / 127 over the head's
            D values (PPL.LLM's per-head-per-token scheme). The scales live in a tensor paged like
            the cache, [Hkv, num_blocks, block_size], so a block id addresses a block's scales too.
  fp8       alias of fp8_e4m3
  fp8_e4m3  torch.float8_e4m3fn with one float32 scale per tensor (per layer, K and V apart)
  fp8_e5m2  torch.float8_e5m2, likewise
The fp8 scale is 1.0, vLLM's default when a checkpoint carries no k_scale / v_scale (tokenmill reads
none yet): values are only clamped to the format's range, which the K/V of the models measured fit.

The C++ kernels (kernels/cpu/paged_attention.cpp) quantize on write and dequantize in the decode
loop the same way; these functions are their reference and the PyTorch fallback's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The smallest int8 scale: an all-zero head row quantizes to zeros instead of 0 / 0.
INT8_MIN_SCALE = 1e-10


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; supported: {', '.join(KV_CACHE_DTYPES)}")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors hold."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8 or cache.dtype in FP8_DTYPES


@dataclass
class KVScales:
    """The scales of one layer's quantized K and V caches.

    int8: [Hkv, num_blocks, block_size] float32, one per cache row (copied with their blocks);
    fp8: [1] float32, one per tensor."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cache_dtype: torch.dtype, cache_shape: tuple[int, ...], device: torch.device) -> "KVScales | None":
        if cache_dtype == torch.int8:
            # Ones, so a never-written row (the null block) dequantizes its zeros to zeros.
            return cls(*(torch.ones(cache_shape[:3], dtype=torch.float32, device=device) for _ in range(2)))
        if cache_dtype in FP8_DTYPES:
            return cls(*(torch.ones(1, dtype=torch.float32, device=device) for _ in range(2)))
        return None


def scale_tensors(scales: KVScales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(K's, V's) scales of a quantized cache, (None, None) for an unquantized one."""
    return (None, None) if scales is None else (scales.k, scales.v)


def scale_bytes_per_block(cache_dtype: torch.dtype, num_kv_heads: int, block_size: int) -> int:
    """Bytes of K and V scales one block of a layer adds (int8's per-row scales; fp8's per-tensor ones are nothing)."""
    return 2 * num_kv_heads * block_size * 4 if cache_dtype == torch.int8 else 0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]): x ~ q * scale, scale = max|x| / 127 per row."""
    xf = x.float()
    # Times float32(1 / 127), not / 127: the write kernel computes it so, and the two then agree to the bit.
    scale = (xf.abs().amax(dim=-1) * (1.0 / 127.0)).clamp_min(INT8_MIN_SCALE)
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in an fp8 dtype, clamped to its finite range (e4m3fn has no inf; a cast past 448 gives NaN)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, fp8_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x in the cache's dtype, with its per-row scales for int8 (None otherwise)."""
    if cache_dtype == torch.int8:
        return quantize_int8(x)
    if cache_dtype in FP8_DTYPES:
        assert fp8_scale is not None
        return quantize_fp8(x, fp8_scale, cache_dtype), None
    return x.to(cache_dtype), None


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back to dtype: int8 q [..., D] with per-row scale [...], or fp8 with a per-tensor scale [1].
    Computed in float32 (as the decode kernel does), then rounded to dtype once."""
    if q.dtype == torch.int8:
        return (q.float() * scale.unsqueeze(-1)).to(dtype)
    return (q.float() * scale).to(dtype)
