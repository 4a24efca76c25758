"""Activations. Gated MLPs take the fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import cpu as cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.use_cpu_kernels(x) and x.dim() == 2 and x.stride(-1) == 1:
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def get_activation(name: str) -> nn.Module:
    """The activation named in an HF config, implemented by transformers itself so outputs match.
    (Imported here, not at the top: transformers.activations costs over a second of start-up and
    only GPT-2-style models need it.)"""
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ModelLoadError(f"activation {name!r} is not supported")
    return ACT2FN[name]
