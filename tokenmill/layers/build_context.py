"""ModelBuildContext: everything a model is constructed from, in one object.

A model class takes one context (the HF config, the quantization config, the parallel layout,
room for LoRA) and hands it down with a prefix to every layer it builds, so each linear layer,
embedding and LM head asks the quantization config for its method by its own name (e.g.
`model.layers.3.mlp.gate_up_proj`) and, with tensor parallelism, takes its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.distributed.communicator import TPCommunicator
from tokenmill.layers.quantization import QuantizationConfig, UnquantizedConfig


@dataclass
class ModelBuildContext:
    hf_config: Any = None
    quant_config: QuantizationConfig = field(default_factory=UnquantizedConfig)
    parallel: TPCommunicator = field(default_factory=TPCommunicator)  # this rank's tensor-parallel group
    lora_config: Any = None  # multi-LoRA: adapters' ranks and targets (not yet)
    max_position: int | None = None  # the rotary table's length (the engine's max_model_len)
    rope_freq_factors: torch.Tensor | None = None  # Llama 3 GGUF files carry them as a tensor


def join_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
