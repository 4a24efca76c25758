"""Generic checkpoint-to-module weight loading through per-parameter weight loaders."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import copy_checked

logger = logging.getLogger(__name__)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    copy_checked(param, loaded, "parameter")


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, int | str]],
    ignore: tuple[str, ...] = (),
) -> None:
    """Copy checkpoint tensors into the model. packed_modules maps a checkpoint module name
    (q_proj) to the fused parameter's module name and shard (qkv_proj, 'q')."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(pattern in name for pattern in ignore):
            continue
        target, shard = name, None
        for source, (fused, shard_id) in packed_modules.items():
            if f".{source}." in name:
                target, shard = name.replace(f".{source}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            logger.warning("checkpoint tensor %s has no matching parameter; ignored", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ModelLoadError as exc:
            raise ModelLoadError(f"cannot load {name}: {exc}") from None
        loaded.add(target)
    # An optional parameter (GPTQ's g_idx, which older checkpoints lack) may stay as created.
    missing = sorted(name for name in set(params) - loaded if not getattr(params[name], "optional", False))
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights the model needs: {shown}")
