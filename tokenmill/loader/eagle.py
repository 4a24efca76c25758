"""Load an EAGLE draft head from a checkpoint folder in EAGLE-1/2's layout (yuhuili/EAGLE, what
`tokenmill train-eagle` writes): config.json (a Llama config of the draft's layers, usually
num_hidden_layers 1) and pytorch_model.bin or model.safetensors with `fc.weight` (hidden x 2 hidden),
`fc.bias` if any, and the layers' `layers.{i}.self_attn|mlp.*` and norms (no input norm in layer 0);
optionally tokenmill's `draft_vocab` (int64 token ids the drafts may take; models/eagle.py)."""

from __future__ import annotations

import json
import os

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.layers.build_context import ModelBuildContext
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.loader.medusa import load_state_file
from tokenmill.models.eagle import EagleDraftModel

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_NOT_LAYER_KEYS = ("architectures", "model_type", "auto_map", "torch_dtype", "dtype", "layer_types")
_LAYER_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # the decoder layers tokenmill's Llama implementation builds


def read_eagle_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config.json's dict, the state dict, the weights file), or a ModelLoadError naming what is wrong."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path}: not an EAGLE draft head folder (no config.json); make one with `tokenmill train-eagle`")
    with open(config_path) as f:
        config = json.load(f)
    weights = next((os.path.join(path, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))), None)
    if weights is None:
        raise ModelLoadError(f"{path}: no EAGLE weights ({' or '.join(WEIGHT_FILES)})")
    state = load_state_file(weights)
    if any(name.startswith("midlayer.") for name in state) or "d2t" in state:
        raise ModelLoadError(f"{weights}: an EAGLE-3 draft head (midlayer, d2t); only EAGLE-1/2's layout (fc + layers) is supported")
    if "fc.weight" not in state or not any(name.startswith("layers.0.") for name in state):
        raise ModelLoadError(f"{weights}: not an EAGLE-1/2 draft head: it needs fc.weight and layers.0.*, "
                             f"found {', '.join(sorted(state)[:4])}{' ...' if len(state) > 4 else ''}")
    return config, state, weights


def eagle_hf_config(config: dict, path: str):
    """The draft layers' config as transformers' LlamaConfig (what tokenmill's Llama layers read)."""
    from transformers import LlamaConfig

    model_type = config.get("model_type", "llama")
    if model_type not in _LAYER_TYPES:
        raise ModelLoadError(f"{path}: EAGLE draft layers of model_type {model_type!r} are not supported; supported: {', '.join(_LAYER_TYPES)}")
    values = {k: v for k, v in config.items() if k not in _NOT_LAYER_KEYS}
    try:
        hf_config = LlamaConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: not a Llama config for the EAGLE layers ({exc})") from None
    hf_config.model_type = model_type  # qwen2's qkv bias, qwen3's q/k norms
    return hf_config


def load_eagle_head(path: str, target_hf_config, device: torch.device, dtype: torch.dtype, max_position: int,
                    quantization: str | None = None) -> EagleDraftModel:
    """quantization: None, or "int8" for the head's layers (weight-only, a scale per output channel; CPU only)."""
    from tokenmill.loader import _default_dtype

    config, state, weights = read_eagle_checkpoint(path)
    hf_config = eagle_hf_config(config, path)
    hidden = int(target_hf_config.hidden_size)
    if int(hf_config.hidden_size) != hidden or tuple(state["fc.weight"].shape) != (hidden, 2 * hidden):
        raise ModelLoadError(f"{weights}: an EAGLE head for hidden size {hf_config.hidden_size} (fc {tuple(state['fc.weight'].shape)}), "
                             f"but the model's hidden size is {hidden}: a head for another model?")
    if "vocab_size" in config and int(config["vocab_size"]) != int(target_hf_config.vocab_size):
        raise ModelLoadError(f"{path}/config.json: an EAGLE head for {config['vocab_size']} tokens, the model has {target_hf_config.vocab_size}")
    draft_vocab = state.pop("draft_vocab", None)
    vocab = int(target_hf_config.vocab_size)
    if draft_vocab is not None:
        if draft_vocab.dim() != 1 or draft_vocab.dtype not in (torch.int32, torch.int64) or len(draft_vocab) == 0 \
                or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
            raise ModelLoadError(f"{weights}: draft_vocab must be a non-empty 1-D tensor of token ids below {vocab}")
        draft_vocab = draft_vocab.to(device=device, dtype=torch.int64)
    # None or "none": UnquantizedConfig(device, dtype), as before; "int8": the weight-only method (CPU only).
    quant = get_quantization_config(quantization, None, device, dtype)
    ctx = ModelBuildContext(hf_config=hf_config, quant_config=quant, max_position=max_position)
    with _default_dtype(dtype), device:
        model = EagleDraftModel(ctx, fc_bias="fc.bias" in state, draft_vocab=draft_vocab)
    try:
        model.load_weights(state.items())
    except ModelLoadError as exc:
        raise ModelLoadError(f"{weights}: {exc}") from None
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def save_eagle_head(state: dict[str, torch.Tensor], config: dict, path: str) -> None:
    """Write a head in EAGLE-1/2's layout: config.json and model.safetensors (float32, and int64 draft_vocab)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    # Weights in float32; the draft vocabulary stays token ids.
    save_file({k: v.detach().to(torch.float32 if v.is_floating_point() else torch.int64).contiguous().cpu() for k, v in state.items()},
              os.path.join(path, WEIGHT_FILES[0]))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
