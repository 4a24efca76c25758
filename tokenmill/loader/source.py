"""ModelSource: what a loader hands the engine, whatever the file format."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class ModelSource:
    name: str  # what the user called it (path), for messages and the served model name
    hf_config: object  # a transformers PretrainedConfig
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # HF-named tensors in HF layout
    tokenizer: object | None  # a transformers tokenizer, or None (token ids only)
    eos_token_ids: set[int] = field(default_factory=set)
    checkpoint_dtype: torch.dtype | None = None
    rope_freq_factors: torch.Tensor | None = None  # llama.cpp's baked llama3 RoPE factors
    # A GGUF file's tensors with the quantized ones kept packed (GGUFTensor), for quantization="gguf";
    # None for every other format.
    packed_weights: Callable[[], Iterable[tuple[str, object]]] | None = None

    @property
    def context_length(self) -> int:
        """The model's context length: max_position_embeddings, or GPT-2's n_positions."""
        return getattr(self.hf_config, "max_position_embeddings", None) or getattr(self.hf_config, "n_positions")


def eos_ids_from(*values) -> set[int]:
    """Collect EOS ids from config / generation config / tokenizer values (int, list or None)."""
    out: set[int] = set()
    for value in values:
        if value is None:
            continue
        if isinstance(value, int):
            out.add(value)
        else:
            out.update(int(v) for v in value)
    return out
