"""Quantization methods: how each linear layer, embedding and LM head holds its weights and computes.

A QuantizationConfig picks a method per layer at construction (by the layer's prefix, so a config
can leave some layers, e.g. the LM head, in full precision). The methods create the layer's
parameters, each with its own weight_loader, so fused and sharded weights load the same way
whatever the format. `get_quantization_config` maps the user's `quantization=` name to a config.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.layers.quantization.base import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig
from tokenmill.layers.quantization.unquantized import (
    PackedCPUWeight,
    UnquantizedConfig,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    cpu_packed_weights_supported,
)
from tokenmill.layers.quantization.w8a8 import W8A8Config
from tokenmill.layers.quantization.weight_only import WeightOnlyConfig

# The `quantization=` names tokenmill runs, and the options each takes (`quantization_options=`).
SUPPORTED = {"int8": (), "int4": ("group_size", "symmetric"), "w8a8": ()}
# vLLM's names for methods tokenmill does not run yet: refused by name rather than as unknown.
NOT_YET = ("gguf", "gptq", "awq", "compressed-tensors", "fp8")


def check_quantization(name: str | None, options: dict[str, Any] | None = None) -> None:
    """A ValueError naming what is supported, for a method or an option tokenmill does not run."""
    if name is None or name == "none":
        if options:
            raise ValueError("quantization_options given without a quantization method")
        return
    supported = ", ".join(SUPPORTED)
    if name in NOT_YET:
        raise ValueError(f"quantization {name!r} is not supported yet; supported: {supported}")
    if name not in SUPPORTED:
        raise ValueError(f"unknown quantization {name!r}; supported: {supported}")
    unknown = sorted(set(options or {}) - set(SUPPORTED[name]))
    if unknown:
        allowed = ", ".join(SUPPORTED[name]) or "none"
        raise ValueError(f"unknown quantization option(s) {', '.join(map(repr, unknown))} for {name!r}; allowed: {allowed}")


def get_quantization_config(name: str | None, options: dict[str, Any] | None, device: torch.device,
                            dtype: torch.dtype) -> QuantizationConfig:
    """The config for the user's `quantization=` name on this device and dtype."""
    check_quantization(name, options)
    if name is None or name == "none":
        return UnquantizedConfig(device, dtype)
    if device.type != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only for now (its kernels are CPU kernels); use device='cpu'")
    if name == "w8a8":
        return W8A8Config(prepack_lm_head=cpu_packed_weights_supported(device, dtype))
    return WeightOnlyConfig(bits=8 if name == "int8" else 4, **(options or {}))


__all__ = [
    "EmbeddingMethodBase",
    "LinearMethodBase",
    "PackedCPUWeight",
    "QuantizationConfig",
    "SUPPORTED",
    "UnquantizedConfig",
    "UnquantizedEmbeddingMethod",
    "UnquantizedLinearMethod",
    "W8A8Config",
    "WeightOnlyConfig",
    "check_quantization",
    "cpu_packed_weights_supported",
    "get_quantization_config",
]
