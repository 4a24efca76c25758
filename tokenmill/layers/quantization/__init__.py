"""Quantization methods: how each linear layer, embedding and LM head holds its weights and computes.

A QuantizationConfig picks a method per layer at construction (by the layer's prefix, so a config
can leave some layers, e.g. the LM head, in full precision). The methods create the layer's
parameters, each with its own weight_loader, so fused and sharded weights load the same way
whatever the format.
"""

from tokenmill.layers.quantization.base import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig
from tokenmill.layers.quantization.unquantized import (
    PackedCPUWeight,
    UnquantizedConfig,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    cpu_packed_weights_supported,
)

__all__ = [
    "EmbeddingMethodBase",
    "LinearMethodBase",
    "PackedCPUWeight",
    "QuantizationConfig",
    "UnquantizedConfig",
    "UnquantizedEmbeddingMethod",
    "UnquantizedLinearMethod",
    "cpu_packed_weights_supported",
]
