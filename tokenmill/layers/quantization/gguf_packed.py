"""`gguf`: a GGUF file's quantized weights kept packed, as the file holds them (Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K, Q6_K), and computed packed (kernels/cpu/gguf_linear.cpp).

The loader hands each quantized tensor over as a GGUFTensor (its packed rows, GGML type and number
of columns) and the unquantized ones (norms, F16/F32 weights) as float tensors. Every linear
layer, the embedding and the LM head keep their GGUFTensor; a decode step's few rows run the
packed kernel, which dequantizes each block in registers to the very float32 values gguf's
dequantize gives, so the model computes what its dequantized copy computes up to the summation
order. A prompt chunk (many rows) dequantizes the weight once and runs the float GEMM. Linear
layers in Q8_0, Q4_0, Q4_1 and Q6_K move onto the weight-only methods' tiles instead (TiledSegment:
the same values, their faster kernels, up to 64 rows or, for Q4, every row count). Q4_0 / Q4_1
multiply x quantized to int8 per block of 32, as llama.cpp does (option activations="float" keeps
x as it is: then the model computes exactly what its dequantized copy does).

Each GGUF row is independent and holds whole blocks, so tensor parallelism splits a packed tensor
as it splits a float one: output rows for a column-parallel layer, and for a row-parallel one the
input columns on block boundaries (32 values, or 256 for the K-quants); a rank slice that cuts a
block is an error naming the block size.

A fused layer (QKV, gate-up) whose parts have different types (a Q4_K_M file's Q6_K v_proj beside
Q4_K q/k) keeps one packed tensor per run of same-typed parts and computes each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization.base import EmbeddingMethodBase, KernelCall, LinearMethodBase, QuantizationConfig, WeightLoader
from tokenmill.layers.quantization.unquantized import is_lm_head
from tokenmill.layers.quantization.weight_only import (
    bound_linear_call,
    int4_linear_call,
    int4_tiles,
    int8_group_linear_call,
    int8_group_tiles,
    linear_call_kernel,
    quantized_linear,
)

# GGML type ids (gguf.GGMLQuantizationType) computed packed, with (values, bytes) per block.
BLOCKS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
          "Q6_K": (14, 256, 210)}
PACKED_TYPES = {type_id: (name, block, size) for name, (type_id, block, size) in BLOCKS.items()}
FLOAT = 0  # GGML's F32: an unquantized tensor, held as a float tensor in the model dtype
# Rows up to which gguf_linear.cpp's row-at-a-time kernels run (beyond: dequantize + float GEMM). They
# dequantize a weight row once per 4 rows of x, so their cost grows with the rows: 3072 x 1024, bf16,
# Zen 5, kernel against dequantize + GEMM: Q4_K 265 / 366 us at 8 rows, 621 / 440 at 16; Q6_K 566 /
# 404 at 8, 5,123 / 834 at 64. (The tiled types, TiledSegment, take weight_only.KERNEL_MAX_ROWS.)
ROWS_KERNEL_MAX_ROWS = 8


@dataclass
class GGUFTensor:
    """One GGUF tensor as a layer holds it: `data` [rows, row bytes] uint8 packed blocks of
    `ggml_type` (a PACKED_TYPES id), or [rows, cols] float for FLOAT; `cols`: values per row."""

    data: torch.Tensor
    ggml_type: int
    cols: int

    @classmethod
    def of(cls, loaded: "GGUFTensor | torch.Tensor", dtype: torch.dtype) -> "GGUFTensor":
        """A loaded tensor as a GGUFTensor: packed ones as they are, float ones (2-D) in dtype."""
        if isinstance(loaded, GGUFTensor):
            return loaded
        if loaded.dim() != 2:
            raise ModelLoadError(f"expected a 2-D weight, got shape {tuple(loaded.shape)}")
        return cls(loaded.to(dtype), FLOAT, int(loaded.shape[1]))

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def block(self) -> tuple[int, int]:
        """(values, bytes) per block; (1, element size) for a float tensor."""
        if self.ggml_type == FLOAT:
            return 1, self.data.element_size()
        return PACKED_TYPES[self.ggml_type][1:]

    def narrow_rows(self, start: int, count: int) -> "GGUFTensor":
        return GGUFTensor(self.data.narrow(0, start, count), self.ggml_type, self.cols)

    def narrow_cols(self, first: int, count: int, what: str) -> "GGUFTensor":
        """Columns [first, first + count): whole blocks only."""
        if first == 0 and count == self.cols:
            return self
        values, size = self.block
        if first % values or count % values:
            raise ModelLoadError(f"{what}: input columns [{first}, {first + count}) do not fall on whole blocks of {values} "
                                 f"values ({PACKED_TYPES[self.ggml_type][0]}): tensor parallelism cannot split this GGUF "
                                 "tensor there; use a smaller tensor_parallel_size")
        return GGUFTensor(self.data.narrow(1, first // values * size, count // values * size), self.ggml_type, count)

    def dequantize(self, dtype: torch.dtype, with_kernels: bool) -> torch.Tensor:
        """The float [rows, cols] weight in dtype (the kernel, or gguf's numpy dequantize without it)."""
        if self.ggml_type == FLOAT:
            return self.data.to(dtype)
        if with_kernels:
            return cpu_kernels.gguf_dequantize(self.data, self.ggml_type, self.cols, dtype)
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(self.data.numpy(), self.ggml_type))).view(self.rows, self.cols).to(dtype)


def q6_k_values(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [rows, blocks, 210] -> (q [rows, blocks * 256] int8 in -32..31, the int8 scale of each 16
    values [rows, blocks * 16], the block's fp16 d [rows, blocks]): a value is q x scale x d. A block: 128 bytes of low
    nibbles (ql), 64 of high bit pairs (qh), 16 int8 scales, fp16 d; each half of 128 values takes 64
    bytes of ql and 32 of qh: values l, l + 32, l + 64, l + 96 (l < 32) are ql[l] & 15, ql[l + 32] &
    15, ql[l] >> 4, ql[l + 32] >> 4 with qh[l]'s bits 0-1, 2-3, 4-5, 6-7 on top, minus 32."""
    rows, count = blocks.shape[:2]
    ql, qh = blocks[..., :128].view(rows, count, 2, 2, 32), blocks[..., 128:192].view(rows, count, 2, 1, 32)
    low = torch.stack([ql & 15, ql >> 4], dim=3).view(rows, count, 2, 4, 32)  # [.., half, value l + 32 j]
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).view(rows, count * 256)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).view(rows, count * 16)
    d = blocks[..., 208:210].contiguous().view(torch.float16).view(rows, count)
    return q, scales, d


@dataclass
class TiledSegment:
    """A Q8_0, Q4_0, Q4_1 or Q6_K tensor moved onto the weight-only methods' tiles (decode_linear.cpp):
    Q8_0's int8 values with their fp16 scale per block (int8_group_linear), Q4_0/Q4_1's nibbles as they
    are with their fp16 scales and mins (the int4 method's kernels, on x quantized to int8 per block of
    32, as llama.cpp computes them; Q4_0's min is -8 times its scale), Q6_K's values as int8 with the
    file's int8 scale per 16 and fp16 d per 256 (8.6 bits a weight against the file's 6.56: its row
    kernel streams at a third of the speed). The same weights as the file's; those kernels stream
    faster than gguf_linear.cpp's rows."""

    tensors: tuple  # the kernel's weight arguments: (tiles, scale, super scale or None, group) or (tiles, scale, min, group)
    ggml_type: int  # the file's type
    linear_call: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

    @classmethod
    def of(cls, weight: GGUFTensor, int8_activations: bool) -> "TiledSegment | None":
        """The tiles of a Q8_0 / Q4_0 / Q4_1 / Q6_K tensor where the CPU kernels run; None for other types.
        int8_activations: Q4_0 / Q4_1 against x quantized to int8 (int4_linear_a8), else against x as it is."""
        name, values, size = PACKED_TYPES.get(weight.ggml_type, (None, 0, 0))
        if name not in ("Q8_0", "Q4_0", "Q4_1", "Q6_K") or not cpu_kernels.cpu_kernels_available():
            return None
        blocks = weight.data.contiguous().view(weight.rows, weight.cols // values, size)
        if name == "Q6_K":
            q, scale, d = q6_k_values(blocks)
            return cls._on_int8_tiles(weight, q, scale, group=16, super_scale=d)
        scale = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        if name == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).reshape(weight.rows, weight.cols)
            return cls._on_int8_tiles(weight, q, scale, group=values)
        minimum = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if name == "Q4_1" else -8.0 * scale.float()
        nibbles = blocks[..., size - values // 2:].reshape(weight.rows, weight.cols // 2)
        tensors = (*int4_tiles(nibbles, scale.float(), minimum), values)
        return cls(tensors, weight.ggml_type, int4_linear_call(tensors, weight.rows, on_kernels=True, int8_activations=int8_activations))

    @classmethod
    def _on_int8_tiles(cls, weight: GGUFTensor, q: torch.Tensor, scale: torch.Tensor, group: int,
                       super_scale: torch.Tensor | None = None) -> "TiledSegment":
        """int8 values q [rows, cols] with a scale per row and group of `group` values (int8_group_linear; int8
        scales times super_scale per run of groups)."""
        tensors = (*int8_group_tiles(q, scale, super_scale), group)
        return cls(tensors, weight.ggml_type, int8_group_linear_call(tensors, weight.rows))


def packed_linear(x: torch.Tensor, weight: "GGUFTensor | TiledSegment", bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias: the packed kernel for a decode step's rows, else dequantize + the float GEMM."""
    if isinstance(weight, TiledSegment):
        return weight.linear_call(x, bias)
    if weight.ggml_type == FLOAT:
        return F.linear(x, weight.data.to(x.dtype), bias)
    return quantized_linear(x, bias, lambda rows: cpu_kernels.gguf_linear(rows, weight.data, weight.ggml_type, weight.cols, bias),
                            weight.dequantize, ROWS_KERNEL_MAX_ROWS)


def _placeholder(loader: WeightLoader) -> nn.Parameter:
    """The `weight` parameter a GGUF tensor loads into: its shape and dtype come with the tensor."""
    param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    param.weight_loader = loader
    return param


class GGUFLinearMethod(LinearMethodBase):
    def __init__(self, int8_activations: bool) -> None:
        self.int8_activations = int8_activations

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], weight_loader: WeightLoader) -> None:
        self.dtype = torch.get_default_dtype()  # the model's, while it is built
        layer.weight = _placeholder(lambda param, loaded, shard_id=None: self._load(layer, loaded, shard_id))
        layer.gguf_shards = [None] * len(output_sizes)

    def _load(self, layer: nn.Module, loaded: GGUFTensor | torch.Tensor, shard_id: int | str | None) -> None:
        packed = GGUFTensor.of(loaded, self.dtype)
        if shard_id is None and len(layer.shards) > 1:  # one fused tensor in the file: split it by the shards' sizes
            start = 0
            for index, full in enumerate(layer.full_output_sizes):
                self._load_shard(layer, packed.narrow_rows(start, full), index)
                start += full
            return
        self._load_shard(layer, packed, 0 if shard_id is None else layer.shard_index(shard_id))

    def _load_shard(self, layer: nn.Module, packed: GGUFTensor, index: int) -> None:
        """This rank's rows (and, row-parallel, input columns) of one shard."""
        what = layer.prefix or type(layer).__name__
        full = layer.full_output_sizes[index]
        if packed.rows != full or packed.cols != layer.full_input_size:
            raise ModelLoadError(f"{what}: checkpoint tensor is [{packed.rows}, {packed.cols}], expected [{full}, {layer.full_input_size}]")
        shard = layer.shards[index]
        first, count = getattr(layer, "input_slice", None) or (0, layer.full_input_size)
        local = packed.narrow_rows(shard.checkpoint_start, shard.size).narrow_cols(first, count, what)
        layer.gguf_shards[index] = GGUFTensor(local.data.contiguous(), local.ggml_type, local.cols)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = layer.gguf_shards
        if any(shard is None for shard in shards):
            raise ModelLoadError(f"{layer.prefix}: the checkpoint lacks {sum(s is None for s in shards)} of its {len(shards)} parts")
        segments: list[GGUFTensor] = []  # runs of consecutive same-typed shards, stacked
        for shard in shards:
            if segments and segments[-1].ggml_type == shard.ggml_type:
                last = segments[-1]
                segments[-1] = GGUFTensor(torch.cat([last.data, shard.data]), last.ggml_type, last.cols)
            else:
                segments.append(shard)
        layer.gguf_segments = [TiledSegment.of(segment, self.int8_activations) or segment for segment in segments]
        del layer.gguf_shards
        single = len(segments) == 1 and isinstance(layer.gguf_segments[0], GGUFTensor)
        layer.weight.data = segments[0].data if single else torch.empty(0, dtype=torch.uint8)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        segments = layer.gguf_segments
        if len(segments) == 1:
            return packed_linear(x, segments[0], bias)
        y = torch.cat([packed_linear(x, segment, None) for segment in segments], dim=-1)
        return y if bias is None else y + bias

    def bound_apply(self, layer: nn.Module, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        call = _whole_tiled_call(layer)
        return super().bound_apply(layer, bias) if call is None else bound_linear_call(call, bias)

    def decode_kernel(self, layer: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype) -> KernelCall | None:
        call = _whole_tiled_call(layer)
        return None if call is None else linear_call_kernel(call, bias, dtype)


def _whole_tiled_call(layer: nn.Module) -> Callable | None:
    """The linear_call of a layer held as one TiledSegment (its kernel's op with the weights bound), else None."""
    segments = layer.gguf_segments
    return segments[0].linear_call if len(segments) == 1 and isinstance(segments[0], TiledSegment) else None


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The token embedding (rows dequantized as they are looked up) and the LM head (the packed
    linear). The GGUFTensor rides on the weight Parameter, so a tied LM head, which shares the
    embedding's Parameter, reads it too. An LM head in Q8_0 / Q4_0 / Q4_1 / Q6_K also keeps a
    TiledSegment copy for its matmul (a tied one: the embedding keeps gathering the file's rows), e.g.
    SmolLM2's Q8_0 head: 30 MB more, its logits ~2x faster than gguf_linear.cpp's rows; a 1B Llama's
    Q6_K head (49152 x 2048): 123 MB beside the file's 82, 3.69 -> 3.05 ms a token."""

    def __init__(self, lm_head: bool, int8_activations: bool) -> None:
        self.int8_activations = int8_activations
        self.lm_head = lm_head

    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int, weight_loader: WeightLoader) -> None:
        self.dtype = torch.get_default_dtype()
        layer.weight = _placeholder(lambda param, loaded, shard_id=None: self._load(layer, param, loaded, num_embeddings, embedding_dim))

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded: GGUFTensor | torch.Tensor, shard_rows: int, dim: int) -> None:
        packed = GGUFTensor.of(loaded, self.dtype)
        what = layer.prefix or type(layer).__name__
        if packed.rows != layer.num_embeddings or packed.cols != dim:
            raise ModelLoadError(f"{what}: checkpoint tensor is [{packed.rows}, {packed.cols}], expected [{layer.num_embeddings}, {dim}]")
        local = packed.narrow_rows(layer.vocab_start, layer.vocab_end - layer.vocab_start).data
        # The last rank's padding rows: zero bytes are zero weights in every block type (fp16 scales of 0).
        padding = local.new_zeros(shard_rows - local.shape[0], local.shape[1])
        param.data = torch.cat([local, padding]) if padding.numel() else local.contiguous()
        param.gguf = GGUFTensor(param.data, packed.ggml_type, packed.cols)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        weight: GGUFTensor = layer.weight.gguf
        rows = GGUFTensor(weight.data.index_select(0, input_ids.reshape(-1)), weight.ggml_type, weight.cols)
        return rows.dequantize(self.dtype, cpu_kernels.use_cpu_kernels(rows.data)).view(*input_ids.shape, weight.cols)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        gguf = getattr(layer.weight, "gguf", None)
        layer.gguf_tiled = TiledSegment.of(gguf, self.int8_activations) if self.lm_head and gguf is not None else None

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if layer.gguf_tiled is not None:
            return layer.gguf_tiled.linear_call(hidden, None)
        return packed_linear(hidden, layer.weight.gguf, None)


class GGUFConfig(QuantizationConfig):
    """Every linear layer, the embedding and the LM head as the GGUF file holds them. activations
    ("int8", the default, or "float"): what Q4_0 / Q4_1 layers multiply, x quantized to int8 per block
    of 32 as llama.cpp does (int4_linear_a8: its speed, and its rounding of x), or x itself (the very
    products of the file's dequantized weights)."""

    name = "gguf"
    ACTIVATIONS = ("int8", "float")

    def __init__(self, activations: str = "int8") -> None:
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"gguf's activations option must be one of {', '.join(map(repr, self.ACTIVATIONS))}, got {activations!r}")
        self.int8_activations = activations == "int8"

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return GGUFLinearMethod(self.int8_activations)

    def embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return GGUFEmbeddingMethod(lm_head=is_lm_head(prefix), int8_activations=self.int8_activations)
