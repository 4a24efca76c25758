"""Model loading: pick the format, build the model on its device, load its weights."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.communicator import TPCommunicator
from tokenmill.errors import ModelLoadError
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.quantization import QuantizationConfig, UnquantizedConfig
from tokenmill.loader.default_model import default_model_path
from tokenmill.loader.gguf_file import load_gguf_source
from tokenmill.loader.hf import load_hf_source
from tokenmill.loader.source import ModelSource
from tokenmill.models.registry import get_model_class


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def load_model_source(config: ModelConfig) -> ModelSource:
    path = config.model or default_model_path()
    # GGUF files go by their magic too: Ollama's blobs and renamed downloads have no .gguf suffix.
    if path.lower().endswith(".gguf") or (os.path.isfile(path) and _has_gguf_magic(path)):
        return load_gguf_source(path, config.tokenizer, config.skip_tokenizer_init)
    if os.path.isdir(path):
        return load_hf_source(path, config.tokenizer, config.skip_tokenizer_init)
    if os.path.exists(path):
        raise ModelLoadError(f"{path}: not a model; give an HF model folder or a .gguf file")
    raise ModelLoadError(f"{path}: no such model folder or file (models are loaded from local paths only)")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(source: ModelSource, device: torch.device, dtype: torch.dtype, max_position: int,
                quant_config: QuantizationConfig | None = None, parallel: TPCommunicator | None = None) -> nn.Module:
    """The model on its device: constructed from one ModelBuildContext, weights loaded, then each
    layer's method turns its loaded parameters into what it computes with. With tensor parallelism
    (parallel: this rank's group) each layer keeps only its rank's slice of each checkpoint tensor."""
    quant_config = quant_config or UnquantizedConfig(device, dtype)
    weights = source.weights
    if quant_config.name == "gguf":
        if source.packed_weights is None:
            raise ModelLoadError(f"quantization='gguf' computes a GGUF file's packed weights, and {source.name} is not a GGUF "
                                 "file: give a .gguf model, or quantize this checkpoint at load with int8, int4 or w8a8")
        weights = source.packed_weights
    ctx = ModelBuildContext(
        hf_config=source.hf_config,
        quant_config=quant_config,
        parallel=parallel or TPCommunicator(),
        max_position=max_position,
        rope_freq_factors=source.rope_freq_factors,
    )
    model_class = get_model_class(source.hf_config)
    with _default_dtype(dtype), device:
        model = model_class(ctx)
    model.load_weights(weights())
    quant_config.process_model_after_loading(model)
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()
