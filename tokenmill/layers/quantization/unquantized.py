"""Full-precision weights; on CPUs with native bf16, weights prepacked once for oneDNN."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization.base import EmbeddingMethodBase, KernelCall, LinearMethodBase, QuantizationConfig, WeightLoader


def cpu_packed_weights_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked matmul: float32 on any x86 CPU oneDNN runs on (it beats F.linear's MKL path
    at decode sizes, which uses one thread: SmolLM2 float32 decode 1.8x faster on Zen 4), bf16 on
    CPUs with native bf16 (AVX512-BF16, AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Rows up to which a decode step's matmul runs in the CPU kernels' dense_linear rather than oneDNN
# (`python benchmarks/decode_linear.py` times both per step; per weight, dense_linear measured
# faster on every SmolLM2 shape up to 8 rows, bf16 and float32, and slower at 16).
DECODE_MAX_ROWS = 8
# bf16 where dense_linear multiplies pairs with vdpbf16ps (AVX512-BF16), eight rows at a time: up to
# here. Layers streamed from memory, Zen 5, oneDNN's time over dense_linear's at 8 / 16 / 32 / 64
# rows: SmolLM2's 1.22x / 1.17x / 1.12x / 1.10x, the 113M Llama's (768 wide) 1.12x / 1.11x / 1.05x /
# 0.98x, a 1B Llama's 1.05x / 0.97x / 1.05x (float32, SmolLM2: 1.0x at 8-16, 0.94x at 32, so it
# keeps DECODE_MAX_ROWS).
DECODE_MAX_ROWS_PAIRED_BF16 = 32


def decode_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which a weight of this dtype with a dense_linear copy takes it (the CPU kernels loaded)."""
    return DECODE_MAX_ROWS_PAIRED_BF16 if dtype == torch.bfloat16 and cpu_kernels.bf16_pairs() else DECODE_MAX_ROWS


# Weights up to this size keep a second copy in dense_linear's layout beside oneDNN's packed one,
# for decode steps. It pays at every size (oneDNN's ~9 us a call beyond its reads, and its slower
# streaming: SmolLM2's 56 MB LM head 1.2x, gate-up 1.3x at one row), but costs the weight's bytes
# again: up to a small model's LM head (SmolLM2's 56 MB; a 113M Llama's 75 MB measured no gain
# in its decode step, 1.13x with it on oneDNN and 1.14x without), not a 7B model's MLP.
# TOKENMILL_DECODE_COPIES=0 keeps none (oneDNN at every row count), for tight memory.
DECODE_COPY_MAX_BYTES = 64 << 20
DECODE_COPIES_ENV = "TOKENMILL_DECODE_COPIES"


def decode_copies_enabled() -> bool:
    """Whether weights may keep a copy in dense_linear's layout: the CPU kernels loaded, and not turned off."""
    return os.environ.get(DECODE_COPIES_ENV, "1") != "0" and cpu_kernels.cpu_kernels_available()


def dense_only_supported(dtype: torch.dtype) -> bool:
    """Whether a weight built with dense_only=True keeps dense_linear's copy alone: bf16 where dense_linear
    multiplies pairs (an LM head measured at least level with oneDNN up to 512 rows there; the float32
    kernels take at most 8 rows a pass, so float32 heads keep oneDNN's copy)."""
    return dtype == torch.bfloat16 and decode_copies_enabled() and cpu_kernels.bf16_pairs()


class PackedCPUWeight:
    """A weight (bf16 or float32) reordered once into oneDNN's blocked layout, as inductor's freezing pass does.

    F.linear reorders the weight on every call; at decode batch sizes that costs as much as the
    matmul itself (measured: 2-4x faster at one row, 10-40% at 32-64 rows). A decode step's rows (up
    to decode_max_rows) run the CPU kernels' dense_linear instead, on a copy in its own layout kept
    for weights of at most DECODE_COPY_MAX_BYTES.

    dense_only (an LM head): multiplied at decode row counts in nearly every step (one row per sampled
    request), at prompt lengths only for prompt logprobs. Where dense_only_supported, dense_linear's
    layout alone, at every row count: 113M Llama's head (49,152 x 768, bf16, Zen 4) 1.84x oneDNN's
    speed at one row, 1.13x at 32, 1.0x at 256-512, 0.98x at 1,024; one copy of the weight, not two.
    """

    def __init__(self, weight: torch.Tensor, dense_only: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self._matmul = torch.ops.mkldnn._linear_pointwise.default  # the overload itself: no lookup per call
        dense_only = dense_only and dense_only_supported(weight.dtype)
        self.packed = None if dense_only else torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.decode_packed = None
        if dense_only or (weight.numel() * weight.element_size() <= DECODE_COPY_MAX_BYTES and decode_copies_enabled()):
            self.decode_packed = cpu_kernels.dense_pack(weight)
            self._dense = torch.ops.tokenmill_cpu.dense_linear.default
            self.decode_max_rows = sys.maxsize if dense_only else decode_max_rows(weight.dtype)

    def bound(self, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """self(x, bias) for 2-D contiguous rows, as a function of x alone (LinearMethodBase.bound_apply)."""
        if self.decode_packed is None:
            return lambda x: self(x, bias)
        out_features, dense, max_rows = self.out_features, self._dense, self.decode_max_rows

        def call(x: torch.Tensor) -> torch.Tensor:
            packed = self.decode_packed  # read per call: benchmarks/decode_linear.py takes it away and back
            if packed is not None and x.shape[0] <= max_rows and x.dtype == packed.dtype:
                return dense(x, packed, out_features, bias)
            return self(x, bias)

        return call

    def decode_kernel(self, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        """bound(bias)'s dense_linear call for rows of x in dtype (LinearMethodBase.decode_kernel)."""
        if self.decode_packed is None or dtype != self.decode_packed.dtype:
            return None
        return KernelCall("tokenmill_cpu::dense_linear", (self.decode_packed, self.out_features, bias), self.decode_max_rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # A decode step's rows come 2-D and contiguous: then no reshape, pad or slice (each a dispatch of
        # ~1 us, at 121 calls a token on SmolLM2).
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        if self.decode_packed is not None and rows <= self.decode_max_rows and x.dtype == self.decode_packed.dtype:
            y = self._dense(flat, self.decode_packed, self.out_features, bias)
        else:
            y = self._bucketed_matmul(flat, bias)
        return y if flat is x else y.view(*x.shape[:-1], self.out_features)

    def _bucketed_matmul(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """oneDNN's matmul at bucketed row counts: `flat` padded up to its bucket, or split at unpadded_head."""
        rows = flat.shape[0]
        padded = bucketed_rows(rows)
        head = unpadded_head(rows) if padded != rows else 0
        if head:  # both pieces take this path again: the head is a bucket, the rest pads to its own
            return torch.cat([self._bucketed_matmul(flat[:head], bias), self._bucketed_matmul(flat[head:], bias)])
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        y = self._matmul(flat, self.packed, bias, "none", [], "")
        return y if padded == rows else y[:rows]


def bucketed_rows(rows: int) -> int:
    """The row count a packed matmul runs at: `rows` up to 8, above that rounded up to 4 steps per octave
    (16, 24, 32, 40, 48, 56, 64, 80, 96, ...: at most 7 padding rows up to 64, at most 25% above).

    oneDNN JIT-compiles and caches a primitive per input shape: about 0.6 MB of code and buffers and
    4-5 ms each (measured on Zen 5). A server's steps have every row count from 1 to the token budget,
    so unpadded its cache grew by megabytes per new batch size, up to the cache's 1,024 entries (over
    600 MB), and every new size paid the compile inside a step. Buckets bound that to a few dozen
    shapes per weight, which the first minutes of traffic compile; the padding rows cost little, as
    small batches are bound by reading the weight and large ones pad by a small fraction."""
    if rows <= 8:
        return rows
    step = _bucket_step(rows)
    return -(-rows // step) * step


def _bucket_step(rows: int) -> int:
    return max(8, 1 << ((rows - 1).bit_length() - 3))


# Row counts from which a matmul that its bucket would pad by more than a twelfth is split instead.
# There the multiply, not the weight's read, sets the time, so a second call reading the weight again
# costs less than the padding rows' arithmetic (up to a quarter more: 1,056 rows ran as 1,280). The
# 113M Llama's four linear shapes, bf16, Zen 4, split over padded: 1,056 rows 1.18x, 2,049 1.20x,
# 1,300 1.08x, 700 1.05x, 520 1.16x, 400 1.07x; at 6-7% padding (300, 600 rows) 0.93-0.98x, so those pad.
SPLIT_MIN_ROWS = 256


def unpadded_head(rows: int) -> int:
    """Where a packed matmul of `rows` rows splits: the largest bucket below `rows` (the rest runs as its
    own matmul, at its own bucket), or 0 to pad all of them to bucketed_rows(rows): a 1,056-row prompt
    runs as 1,024 + 32 rows, not 1,280."""
    if rows < SPLIT_MIN_ROWS or bucketed_rows(rows) - rows <= rows // 12:
        return 0
    return rows // _bucket_step(rows) * _bucket_step(rows)


def _weight(shape: tuple[int, int], weight_loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = weight_loader
    param.output_dim = 0
    return param


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, prepack: bool = False) -> None:
        self.prepack = prepack  # oneDNN-prepacked after loading (CPU bf16); the original is freed

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        layer.weight = _weight((sum(output_sizes), input_size), weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.prepack:
            layer.packed_weight = PackedCPUWeight(layer.weight.data)
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.prepack:
            return layer.packed_weight(x, bias)
        return F.linear(x, layer.weight, bias)

    def bound_apply(self, layer: nn.Module, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.prepack:
            return layer.packed_weight.bound(bias)
        return super().bound_apply(layer, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        return layer.packed_weight.decode_kernel(bias, dtype) if self.prepack else None


class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    def __init__(self, prepack: bool = False) -> None:
        # As an LM head: a prepacked copy for the logits matmul; the weight stays (a tied
        # embedding reads it too).
        self.prepack = prepack

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int, weight_loader: WeightLoader) -> None:
        layer.weight = _weight((num_embeddings, embedding_dim), weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.prepack:
            layer.packed_weight = PackedCPUWeight(layer.weight.data, dense_only=True)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, layer.weight)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.prepack:
            return layer.packed_weight(hidden)
        return F.linear(hidden, layer.weight)


class UnquantizedConfig(QuantizationConfig):
    """No quantization. On CPUs, float32 weights and (with native bf16) bf16 ones are prepacked for oneDNN: linear layers and the LM head."""

    name = "none"

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        self.prepack = device is not None and dtype is not None and cpu_packed_weights_supported(device, dtype)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod(self.prepack)

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        # Only the LM head multiplies by the weight; an input embedding only gathers rows.
        return UnquantizedEmbeddingMethod(self.prepack and is_lm_head(prefix))


def is_lm_head(prefix: str) -> bool:
    return prefix == "lm_head" or prefix.endswith(".lm_head")
