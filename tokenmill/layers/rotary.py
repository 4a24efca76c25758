"""Rotary position embedding with the config's theta and scaling (via transformers' RoPE init functions)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import cpu as cpu_kernels


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    # Imported only for scaled RoPE: transformers' modeling utilities cost seconds of start-up.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if rope_type in ("dynamic", "longrope"):
        # transformers recomputes these per forward pass (longrope switches to its long factors once the
        # sequence passes original_max_position_embeddings); one fixed table would be wrong there.
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported (its frequencies depend on the sequence length)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, Hkv, D] rotated by cos/sin [T, D]: in place in one CPU op where it can run,
    else as transformers writes it."""
    if cpu_kernels.use_cpu_kernels(q) and all(x.stride(-1) == 1 and x.stride(1) == x.shape[2] for x in (q, k)):
        cpu_kernels.rotary(q, k, cos, sin)
        return q, k
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        # Scaled RoPE's transformers functions and a GGUF's factors give CPU tensors; the tables belong on
        # the device the model is being built on (loader/__init__.py builds it under `with device:`).
        inv_freq = inv_freq.to(torch.get_default_device())
        if freq_factors is not None:  # llama.cpp's per-frequency factors (llama3 scaling baked into a GGUF)
            inv_freq = inv_freq / freq_factors.float().to(inv_freq.device)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, D]."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)
