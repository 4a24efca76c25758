"""Load Medusa heads from a FasterDecoding/Medusa checkpoint folder: config.json (medusa_num_heads,
medusa_num_layers) and the heads' weights, medusa_lm_head.safetensors or medusa_lm_head.pt. tokenmill's
own extension, `"medusa_lm_head": "shared"` in config.json, marks heads that use the target's LM head
(no per-head LM head weights), as `tokenmill train-medusa` makes by default."""

from __future__ import annotations

import json
import os

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.models.medusa import MedusaHeads

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def load_medusa_heads(path: str, hidden_size: int, vocab_size: int, device: torch.device, dtype: torch.dtype) -> MedusaHeads:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path}: not a Medusa heads folder (no config.json); make one with `tokenmill train-medusa`")
    with open(config_path) as f:
        config = json.load(f)
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise ModelLoadError(f"{config_path}: a Medusa config needs an integer medusa_num_heads (and medusa_num_layers)") from None
    weights = next((os.path.join(path, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))), None)
    if weights is None:
        raise ModelLoadError(f"{path}: no Medusa weights ({' or '.join(WEIGHT_FILES)})")
    state = load_state_file(weights)
    shared = config.get("medusa_lm_head") == "shared"
    heads = MedusaHeads(hidden_size, vocab_size, num_heads, num_layers, shared_lm_head=shared)
    try:
        heads.load_medusa_state_dict(state)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{weights}: {exc.args[0]} (heads for another model? this one has hidden size "
                             f"{hidden_size} and {vocab_size} tokens)") from None
    return heads.to(device=device, dtype=dtype).eval()


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """A head's whole state dict from a .safetensors file or a torch one (.pt, .bin)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_medusa_heads(heads: MedusaHeads, path: str, base_model: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {"medusa_num_heads": len(heads.heads), "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model, "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size}
    if heads.shared_lm_head:
        config["medusa_lm_head"] = "shared"
    save_file({k: v.to(torch.float32).cpu() for k, v in heads.medusa_state_dict().items()}, os.path.join(path, WEIGHT_FILES[0]))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
