"""Normalization layers, computed the way transformers computes them (float32 inside)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with residual: residual + x (the residual stream after a sublayer) and its norm,
        returned as (norm, new residual). On CPU one fused op each; the residual is updated in place there."""
        fused = cpu_kernels.use_cpu_kernels(x) and x.dim() == 2 and x.stride(-1) == 1
        if residual is not None:
            if fused and residual.is_contiguous():
                return cpu_kernels.add_rms_norm(residual, x, self.weight, self.eps), residual
            residual = residual + x
            return self._torch_forward(residual), residual
        return cpu_kernels.rms_norm(x, self.weight, self.eps) if fused else self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)
