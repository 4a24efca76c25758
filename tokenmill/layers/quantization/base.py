"""The interfaces a quantization method implements (vLLM's shape: create_weights, process_weights_after_loading, apply)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WeightLoader = Callable[..., None]  # (param, loaded tensor, shard_id=None) -> None


@dataclass(frozen=True)
class KernelCall:
    """A linear layer's decode kernel as the C++ decode program calls it (kernels/cpu/decode_program.cpp):
    torch.ops.<op>(x, *args), the bias among args, for up to max_rows rows of x (None: any number)."""

    op: str  # the op's qualified name, "tokenmill_cpu::int4_linear"
    args: tuple  # tensors, ints, Nones and the activations' dtype, in the op's order after x
    max_rows: int | None


@dataclass(frozen=True)
class QuantizedInput:
    """A linear layer that takes its input already quantized by the RMSNorm before it (the norm and the
    activation quantize in one op, kernels/cpu/int8_gemm.cpp's w8a8_rms_norm_quant: PPL.LLM's fusion).
    The norm quantizes per row and group of group_size input features; apply(q, scales) and the C++
    decode program's kernel (op(q, scales, *args)) take its output."""

    group_size: int
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    kernel: KernelCall


class LinearMethodBase:
    """How a linear layer holds its weight and computes y = x W^T + b."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        """Register the layer's parameters. Each gets `weight_loader` and `output_dim` (the axis that
        holds output channels), so a fused layer (QKV, gate-up) loads shard by shard whatever the format."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what apply() reads (repack, transpose, quantize...)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bound_apply(self, layer: nn.Module, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """apply(layer, x, bias) as a function of x alone, for a model's decode program (models/llama.py):
        2-D contiguous rows, any number of them. Methods whose kernels take their weights as arguments
        bind them here, so a call skips the lookups and checks of the general path."""
        return lambda x: self.apply(layer, x, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        """The one op bound_apply calls for rows of x in dtype, for the C++ decode program; None where it calls
        something else (Python, several ops), which keeps the layer's model on the Python decode program."""
        return None

    def quantized_input(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantizedInput | None:
        """How the layer takes rows in dtype quantized by the norm before it, for a decode program; None
        (the default) where it takes them as they are."""
        return None


class EmbeddingMethodBase:
    """How a token embedding or an LM head holds its [vocab, hidden] weight."""

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int, weight_loader: WeightLoader) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight: the input embedding."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ weight^T: the LM head's logits (in the model dtype)."""
        raise NotImplementedError


class QuantizationConfig:
    """Picks each layer's method by its prefix (e.g. `model.layers.3.mlp.gate_up_proj`, `lm_head`)."""

    name = "none"

    def linear_method(self, prefix: str) -> LinearMethodBase:
        raise NotImplementedError

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        raise NotImplementedError

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Whole-model work on the loaded float weights before each layer's process_weights_after_loading
        (w8a8's SmoothQuant folding); nothing by default."""


# -- for methods that load the checkpoint's float weight and quantize it after loading ---------------


def float_weight_to_quantize(shape: tuple[int, int], weight_loader: WeightLoader) -> nn.Parameter:
    """The checkpoint's float weight, loaded as is and quantized after loading."""
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = weight_loader
    param.output_dim = 0
    return param


def free_parameter(param: nn.Parameter) -> None:
    """Drop a parameter's storage (the float weight, once quantized)."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [rows, features], what the quantized kernels take."""
    return x.reshape(-1, x.shape[-1]).contiguous()
