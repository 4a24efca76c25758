"""SmoothQuant (Xiao et al., 2023) for `w8a8`: move the outliers of a layer's input into its weight.

A linear layer's input x has a few channels far larger than the rest (SmolLM2-135M: qkv_proj's reaches
5-8 where most channels' absmax is 0.3-1), so one int8 scale per token leaves the other channels few
levels. With a factor s_j per input channel, x W^T = (x / s) (W s)^T exactly; SmoothQuant picks
    s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)        (alpha = 0.5 by default, as the paper's)
so the activations' range shrinks where it is large and the weights (quantized per output channel,
where one column more or less barely moves a row's absmax) take it. x / s costs nothing at run time:
it is folded into whatever produces x. In the Llama family (models/llama.py's smoothing_pairs):
    qkv_proj      <- input_layernorm's weight          (the norm's gamma divided by s)
    gate_up_proj  <- post_attention_layernorm's weight
    down_proj     <- up_proj's output rows (and bias)  (x = silu(gate) * up: up's channel j divided by s_j)
o_proj's input (the attention's output) is left alone, as in the paper.

The per-channel absmax of each layer's input comes from calibration, not from the checkpoint's weights:
an act-scales file, either tokenmill's (`tokenmill calibrate-smoothquant`: safetensors, keyed by the
fused layers' names, `model.layers.3.self_attn.qkv_proj`) or mit-han-lab/smoothquant's act_scales
`.pt` (a dict keyed by the HF modules' names, `model.layers.3.self_attn.q_proj`; q/k/v and gate/up
read the same input, so their entries merge by maximum). Checkpoints that llm-compressor smoothed
(its SmoothQuantModifier) already hold the folded weights, and load as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ModelLoadError

# mit-han-lab's (HF) module names -> the fused layer that reads the same input.
FUSED_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
DEFAULT_ALPHA = 0.5
# A floor under both maxima (mit-han-lab's clamp): a channel that is zero everywhere gets a finite factor.
MIN_ABSMAX = 1e-5


@dataclass(frozen=True)
class SmoothingPair:
    """Where a linear layer's input channels come from: tensors whose first dimension is those channels
    (a norm's weight [K]; the rows [K, ...] of the layer that produces them, and its bias), divided by s,
    while the layer's weight columns are multiplied by s."""

    sources: tuple[torch.Tensor, ...]
    layer: nn.Module  # a Linear whose `weight` is still the checkpoint's float weight


def fused_name(name: str) -> str:
    """A module name as tokenmill's fused layers have it (`...self_attn.q_proj` -> `...self_attn.qkv_proj`)."""
    head, _, last = name.rpartition(".")
    return f"{head}.{FUSED_NAMES[last]}" if last in FUSED_NAMES and head else name


def load_act_scales(path: str) -> dict[str, torch.Tensor]:
    """An act-scales file as {fused layer name: per-input-channel absmax, float32 [K]}."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"smoothquant: no act-scales file at {path}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        raw = load_file(path)
    elif path.endswith((".pt", ".pth", ".bin")):
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle of anything but tensors, or not a torch file at all
            raise ModelLoadError(f"smoothquant: {path} is not a torch file of tensors ({exc.__class__.__name__}: {exc})") from exc
    else:
        raise ModelLoadError(f"smoothquant: {path}: give a .safetensors (tokenmill calibrate-smoothquant) or .pt (mit-han-lab/smoothquant) "
                             "act-scales file")
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 1 for k, v in raw.items()):
        raise ModelLoadError(f"smoothquant: {path} must map module names to 1-D tensors of per-channel absmax")
    scales: dict[str, torch.Tensor] = {}
    for name, value in raw.items():
        key, value = fused_name(name), value.float().abs()
        if key in scales and scales[key].shape != value.shape:
            raise ModelLoadError(f"smoothquant: {path}: {name} has {value.numel()} channels, its fused layer's other entries "
                                 f"{scales[key].numel()}")
        scales[key] = value if key not in scales else torch.maximum(scales[key], value)
    return scales


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|x|^alpha / max|W|^(1 - alpha) per input channel, both maxima floored at MIN_ABSMAX."""
    return act_absmax.clamp(min=MIN_ABSMAX).pow(alpha) / weight_absmax.clamp(min=MIN_ABSMAX).pow(1 - alpha)


def _weight_column_absmax(layer: nn.Module) -> torch.Tensor:
    """max |W[:, j]| over all output channels, every rank's included (a column-parallel layer holds some rows)."""
    local = layer.weight.data.abs().amax(dim=0).float()
    tp = layer.tp
    if tp.size == 1 or layer.input_size != layer.full_input_size:  # one rank, or a row-parallel layer: all rows here
        return local
    gathered = tp.gather_to_driver(local[None], dim=0)
    return tp.broadcast_object(None if gathered is None else gathered.amax(dim=0))


def _rank_channels(layer: nn.Module, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a per-input-channel vector of the whole layer."""
    if layer.input_size == layer.full_input_size:
        return full
    first, count = layer.input_slice
    return full[first:first + count]


def smooth_layers(pairs: list[SmoothingPair], act_scales: dict[str, torch.Tensor], alpha: float) -> None:
    """Folds SmoothQuant's factors into every pair's sources and layer (in place, before the layers quantize)."""
    if not 0.0 <= alpha <= 1.0:
        raise ModelLoadError(f"smoothquant_alpha must be in [0, 1], got {alpha}")
    for pair in pairs:
        layer = pair.layer
        act = act_scales.get(layer.prefix)
        if act is None:
            raise ModelLoadError(f"smoothquant: the act-scales file has no entry for {layer.prefix} (was it calibrated on this model?)")
        if act.numel() != layer.full_input_size:
            raise ModelLoadError(f"smoothquant: {layer.prefix} has {layer.full_input_size} input channels, its act scales {act.numel()}")
        s = smoothing_factors(_rank_channels(layer, act.to(layer.weight.device)), _weight_column_absmax(layer), alpha)
        with torch.no_grad():
            for source in pair.sources:
                source.copy_((source.float() / s.view(-1, *[1] * (source.dim() - 1))).to(source.dtype))
            layer.weight.data.copy_((layer.weight.data.float() * s).to(layer.weight.dtype))
