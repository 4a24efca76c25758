"""ModelSource: what a loader hands the engine, whatever the file format."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


def done(value) -> Future:
    """A future that already holds value."""
    future: Future = Future()
    future.set_result(value)
    return future


def in_background(name: str, fn: Callable[[], object]) -> Future:
    """fn() run in a daemon thread of its own; its result (or its exception) in the future.

    For start-up work that can overlap the weights' loading (which spends its time in torch ops
    that release the GIL): building a tokenizer, importing transformers."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever asks for the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


@dataclass
class ModelSource:
    name: str  # what the user called it (path), for messages and the served model name
    hf_config: object  # a transformers PretrainedConfig, or its attributes (loader/config_cache.py)
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # HF-named tensors in HF layout
    # A transformers tokenizer, or None (token ids only); perhaps still being built in a thread.
    tokenizer_future: Future
    eos_token_ids: set[int] = field(default_factory=set)
    checkpoint_dtype: torch.dtype | None = None
    rope_freq_factors: torch.Tensor | None = None  # llama.cpp's baked llama3 RoPE factors
    # A GGUF file's tensors with the quantized ones kept packed (GGUFTensor), for quantization="gguf";
    # None for every other format.
    packed_weights: Callable[[], Iterable[tuple[str, object]]] | None = None

    @property
    def tokenizer(self):
        """The tokenizer, waiting for it if a thread is still building it (and raising what that raised)."""
        return self.tokenizer_future.result()

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
