"""Quantization methods: how each linear layer, embedding and LM head holds its weights and computes.

A QuantizationConfig picks a method per layer at construction (by the layer's prefix, so a config
can leave some layers, e.g. the LM head, in full precision). The methods create the layer's
parameters, each with its own weight_loader, so fused and sharded weights load the same way
whatever the format. `get_quantization_config` maps the user's `quantization=` name to a config.

Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) say so in config.json's
`quantization_config.quant_method`, as vLLM reads it: that picks the method when `quantization=` is
not given, and a `quantization=` that disagrees is an error (the weights are what they are).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.layers.quantization.awq import AWQConfig
from tokenmill.layers.quantization.base import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig
from tokenmill.layers.quantization.compressed_tensors import CompressedTensorsConfig
from tokenmill.layers.quantization.gguf_packed import GGUFConfig
from tokenmill.layers.quantization.gptq import GPTQConfig
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
SUPPORTED = {"int8": (), "int4": ("group_size", "symmetric"), "w8a8": ("activation_group_size", "quantize_lm_head", "smoothquant", "smoothquant_alpha"), "gguf": ("activations",), "gptq": (), "awq": (), "compressed-tensors": ()}
# The methods that load a checkpoint quantized already (by its config.json's quant_method); the
# others quantize a float checkpoint at load.
PREQUANTIZED = ("gptq", "awq", "compressed-tensors")
# vLLM's names for methods tokenmill does not run yet: refused by name rather than as unknown.
NOT_YET = ("fp8",)


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


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (a dict), or None for a float checkpoint."""
    quant = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if quant is None:
        return None
    if not isinstance(quant, dict):  # a transformers QuantizationConfig object
        quant = quant.to_dict()
    return quant


def _resolve_method(name: str | None, quant: dict[str, Any] | None, hf_config: Any) -> str | None:
    """The method to run: the checkpoint's own when it is pre-quantized (name must agree), else name."""
    prequantized = ", ".join(PREQUANTIZED)
    if quant is None:
        if name in PREQUANTIZED:
            raise ValueError(f"quantization={name!r} loads {name} checkpoints, but this checkpoint's config.json has no "
                             "quantization_config (it is a float checkpoint: use int8, int4 or w8a8 to quantize it at load)")
        return name
    method = str(quant.get("quant_method", "")).lower()
    if method not in PREQUANTIZED:
        raise ValueError(f"this checkpoint is quantized with quant_method {method!r} (config.json quantization_config); "
                         f"tokenmill loads pre-quantized checkpoints of {prequantized}")
    if name is not None and name != method:
        raise ValueError(f"this checkpoint is {method}-quantized (config.json quantization_config), but quantization={name!r} "
                         f"was given: leave quantization unset or give {method!r}")
    if getattr(hf_config, "model_type", None) == "gpt2":
        raise ValueError(f"{method} checkpoints load for Llama-family models; GPT-2's Conv1D layout is not supported")
    return method


def get_quantization_config(name: str | None, options: dict[str, Any] | None, device: torch.device,
                            dtype: torch.dtype, hf_config: Any = None) -> QuantizationConfig:
    """The config for the user's `quantization=` name on this device and dtype. hf_config: the model's
    config, whose `quantization_config` picks the method of a pre-quantized checkpoint."""
    check_quantization(name, options)
    quant = checkpoint_quantization(hf_config)
    name = _resolve_method(name, quant, hf_config)
    if name is None or name == "none":
        return UnquantizedConfig(device, dtype)
    if device.type != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only for now (its kernels are CPU kernels); use device='cpu'")
    if name == "gptq":
        return GPTQConfig(quant, device, dtype)
    if name == "awq":
        return AWQConfig(quant, device, dtype)
    if name == "compressed-tensors":
        return CompressedTensorsConfig(quant, device, dtype)
    if name == "gguf":  # the loader checks that the checkpoint is a GGUF file (build_model)
        return GGUFConfig(**(options or {}))
    if name == "w8a8":
        return W8A8Config(prepack_lm_head=cpu_packed_weights_supported(device, dtype), **(options or {}))
    return WeightOnlyConfig(bits=8 if name == "int8" else 4, **(options or {}))


__all__ = [
    "AWQConfig",
    "CompressedTensorsConfig",
    "EmbeddingMethodBase",
    "GGUFConfig",
    "GPTQConfig",
    "PREQUANTIZED",
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
    "checkpoint_quantization",
    "cpu_packed_weights_supported",
    "get_quantization_config",
]
