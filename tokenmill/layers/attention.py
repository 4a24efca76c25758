"""Attention over the paged KV cache for a mixed batch (decodes and prompt chunks together).

The layer writes the step's new K/V into their cache slots, then attends each query token
to its request's context through the block table, causal within the chunk. The backend is
chosen per device; the torch backend here is the reference and runs anywhere.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.attention_metadata import AttentionGroup, BatchInputs
from tokenmill.layers.kv_quant import FP8_DTYPES, KVScales, is_quantized, quantize, scale_tensors


# TOKENMILL_PROMPT_KERNEL=0 runs prompt chunks through the reference's gather + SDPA path on the CPU
# backend too (for measuring the kernel against it; decodes keep their kernel).
PROMPT_KERNEL_ENV = "TOKENMILL_PROMPT_KERNEL"


class GatherWorkspace:
    """Reused buffers for the gathered K/V context, shared by every layer (they run one after another).

    A fresh tensor for each gather would be tens of MB at long contexts: above glibc's mmap
    threshold, so every layer of every step would map new pages and fault them in, which made
    the gather run at 2 GB/s instead of memory speed.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(numel, buf.numel() if buf is not None else 0), dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


class TorchPagedAttention:
    """Reference backend: gather each group's context blocks; prompt chunks run SDPA with a causal mask,
    decodes (one query token each) run as two batched matmuls.

    A quantized cache (kv_quant.py: int8 with per-row scales, fp8 with a per-tensor scale) is
    quantized on write and dequantized to the query's dtype as it is gathered.

    Why decodes differ: on CPU, SDPA's flash kernel with a single bf16 query row is more than ten times
    slower than the plain matmul-softmax-matmul, and for one query there is nothing to tile. The
    query heads that share a KV head are stacked as that head's query rows (GQA without repeating KV).
    """

    @classmethod
    def forward(
        cls,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: BatchInputs,
        scale: float,
        sliding_window: int | None,
        workspace: GatherWorkspace | None = None,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        # One extra row: padded query slots of prompt groups write their garbage to it.
        out = q.new_empty(num_tokens + 1, num_heads, head_dim)
        q_padded = None  # q plus a zero row that padded query slots read, made once if a prompt group needs it
        for group in batch.attn_groups:  # decodes, then prompt chunks grouped by length
            if group.token_index.shape[1] == 1:
                cls.decode(q, k_cache, v_cache, group, out, scale, sliding_window, workspace, kv_scales)
                continue
            if cls.prompt(q, k_cache, v_cache, group, out, scale, sliding_window, kv_scales):
                continue
            if q_padded is None:
                q_padded = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])
            key, value = _gather_context(k_cache, v_cache, group, workspace, kv_scales, q.dtype)
            b, max_q = group.token_index.shape
            # Chunks that start at position 0 see exactly their own tokens, causally: SDPA's own causal
            # mask (top-left aligned) is that, and its CPU flash kernel runs 1.6x faster without an
            # explicit mask. Later chunks (after cached or earlier tokens) need the mask.
            causal = group.from_start and (sliding_window is None or sliding_window >= max_q)
            o = F.scaled_dot_product_attention(
                q_padded[group.token_index].transpose(1, 2),  # [b, H, max_q, D]
                key[:, :, :max_q].transpose(0, 1) if causal else key.transpose(0, 1),  # [b, Hkv, ctx, D]
                value[:, :, :max_q].transpose(0, 1) if causal else value.transpose(0, 1),
                attn_mask=None if causal else group.mask(k_cache.shape[2], sliding_window),
                is_causal=causal,
                scale=scale,
                enable_gqa=num_heads != k_cache.shape[0],
            )
            out[group.token_index.flatten()] = o.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
        return out[:num_tokens]

    @staticmethod
    def prompt(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> bool:
        """A backend's own path for a prompt-chunk group: True when it wrote out[rows]; the reference has none."""
        return False

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchInputs,
                 kv_scales: KVScales | None = None) -> None:
        """The step's new K/V ([T, Hkv, D]) into their slots, quantized for a quantized cache."""
        # Row copies into the cache viewed as [Hkv * slots, D]: far cheaper than index_copy_ along dim 1.
        head_dim = k_cache.shape[3]
        rows = batch.slot_rows(k_cache.shape[0], k_cache.shape[1] * k_cache.shape[2])
        scales = scale_tensors(kv_scales)
        for cache, new, cache_scale in ((k_cache, k, scales[0]), (v_cache, v, scales[1])):
            values, row_scales = quantize(new.transpose(0, 1).reshape(-1, head_dim), cache.dtype, cache_scale)
            # fp8 as its bytes: torch has no index_copy_ for float8 on CPU.
            _bytes(cache).view(-1, head_dim).index_copy_(0, rows, _bytes(values))
            if row_scales is not None:  # int8: each row's scale beside it
                cache_scale.view(-1).index_copy_(0, rows, row_scales)

    @staticmethod
    def decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        workspace: GatherWorkspace | None,
        kv_scales: KVScales | None = None,
    ) -> None:
        """out[rows] := attention of a decode group's query tokens (one per request) over their contexts."""
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[0]
        group_size = num_heads // num_kv_heads
        b, ctx = group.block_table.shape[0], group.block_table.shape[1] * k_cache.shape[2]
        key, value = _gather_context(k_cache, v_cache, group, workspace, kv_scales, q.dtype)
        mask = group.mask(k_cache.shape[2], sliding_window)  # [b, 1, 1, ctx]
        token_rows = group.token_index[:, 0]
        query = q[token_rows].view(b, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(-1, group_size, head_dim)
        scores = torch.bmm(query, key.view(-1, ctx, head_dim).transpose(1, 2)).float() * scale  # [Hkv*b, group, ctx]
        scores.view(num_kv_heads, b, group_size, ctx).masked_fill_(~mask.view(1, b, 1, ctx), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        o = torch.bmm(probs, value.view(-1, ctx, head_dim))  # [Hkv*b, group, D]
        out[token_rows] = o.view(num_kv_heads, b, group_size, head_dim).transpose(0, 1).reshape(b, num_heads, head_dim)


class CpuPagedAttention(TorchPagedAttention):
    """CPU backend: decodes read K/V straight from the paged cache in tokenmill's C++ kernel
    (tokenmill/kernels/cpu/paged_attention.cpp), new K/V are written there as row copies, and
    prompt chunks attend from the paged cache in a tiled, causal, flash-attention-style kernel
    (tokenmill/kernels/cpu/prefill_attention.cpp).

    Decodes whose block tables start with the same blocks (a prefix cached once and shared: worker/batch.py
    finds it) take cascade attention: the prefix is read once for all of them in the prompt kernel's tiles
    (rows: every decode token's query heads), then each token attends to the rest of its context and the
    two parts are merged by their log-sum-exps. Not with a sliding window (the prefix would need masking).

    The gather it avoids copied every decode's whole context per layer and step: a quarter of a
    batch-32 decode step at a 200-token context, and most of it at 1,000 tokens. For prompt chunks
    after cached or earlier tokens the reference also builds a [b, max_q, ctx] mask and runs SDPA's
    masked path over the gathered copy.
    """

    @staticmethod
    def prompt(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales | None = None,
    ) -> bool:
        if os.environ.get(PROMPT_KERNEL_ENV, "1") == "0":
            return False
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel takes any row stride, not other layouts
            q = q.contiguous()
        first_rows, starts, lens = group.prompt_rows_starts_lens(q.shape[0])
        k_scale, v_scale = scale_tensors(kv_scales)
        cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, first_rows, starts, lens, group.block_table, sliding_window, scale,
                                            k_scale=k_scale, v_scale=v_scale)
        return True

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchInputs,
                 kv_scales: KVScales | None = None) -> None:
        if kv_scales is not None:  # quantized cache: the kernel quantizes each (token, head) row as it writes it
            cpu_kernels.write_kv_quantized(k_cache, v_cache, kv_scales.k, kv_scales.v, k, v, batch.slot_mapping)
            return
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            TorchPagedAttention.write_kv(k_cache, v_cache, k, v, batch)
            return
        cpu_kernels.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)

    @staticmethod
    def decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        out: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        workspace: GatherWorkspace | None,
        kv_scales: KVScales | None = None,
    ) -> None:
        token_rows, positions = group.decode_rows_and_positions()
        k_scale, v_scale = scale_tensors(kv_scales)
        q = q.contiguous()
        prefix = None
        if group.shared_prefix is not None and sliding_window is None:
            # Cascade: the shared prefix once for all the group's tokens, then each token's own rest, merged.
            prefix_len, prefix_blocks = group.shared_prefix
            o, lse = cpu_kernels.cascade_prefix_attention(q, k_cache, v_cache, token_rows, prefix_blocks, prefix_len, scale, k_scale, v_scale)
            prefix = (prefix_len, o, lse)
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, token_rows, group.block_table, positions,
                                           sliding_window, scale, k_scale, v_scale, prefix, group.tree_start, group.tree_mask)


def _gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    workspace: GatherWorkspace | None,
    kv_scales: KVScales | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (KV head, request)'s context as one contiguous matrix: K and V shaped [Hkv, b, ctx, D].

    Head-major cache: index_select over the rows of the flattened [Hkv * blocks] dim is a plain row
    copy, 2x faster than along dim 1 and 7x faster than indexing, and its output feeds bmm as is.
    A quantized cache's rows are gathered as they are stored, then dequantized into `dtype`.
    """
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    b, ctx = group.block_table.shape[0], group.block_table.shape[1] * block_size
    rows = group.kv_rows(num_kv_heads, num_blocks)
    shape = (len(rows), block_size, head_dim)
    scales = scale_tensors(kv_scales)
    out = []
    for name, cache, cache_scale in (("k", k_cache, scales[0]), ("v", v_cache, scales[1])):
        stored = _bytes(cache).view(-1, block_size, head_dim)
        if workspace is not None:
            gathered = torch.index_select(stored, 0, rows, out=workspace.take(name, shape, stored))
        else:
            gathered = stored.index_select(0, rows)
        if is_quantized(cache):
            gathered = _dequantize(gathered.view(cache.dtype), cache_scale, rows, dtype or torch.float32, workspace, name + "_dq")
        out.append(gathered.view(num_kv_heads, b, ctx, head_dim))
    return out[0], out[1]


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (torch's CPU index_copy_ / index_select have no float8 kernels); others as they are."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


def _dequantize(
    gathered: torch.Tensor, cache_scale: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, workspace: GatherWorkspace | None, name: str
) -> torch.Tensor:
    """Gathered quantized blocks [n, block_size, D] in dtype: int8 times each row's scale (computed in float32,
    as kv_quant.dequantize), fp8 widened then times the tensor's scale."""
    like = torch.empty(0, dtype=dtype, device=gathered.device)
    out = workspace.take(name, tuple(gathered.shape), like) if workspace is not None else torch.empty(gathered.shape, dtype=dtype, device=gathered.device)
    if gathered.dtype == torch.int8:
        block_size = gathered.shape[1]
        row_scales = cache_scale.view(-1, block_size).index_select(0, rows)  # the scales' blocks, as the cache's
        torch.mul(gathered, row_scales.unsqueeze(-1), out=out)
    else:
        out.copy_(gathered)
        out.mul_(cache_scale)
    return out


def attention_backend(device: torch.device) -> type[TorchPagedAttention]:
    """The fastest backend that works here: the C++ decode kernel on CPU when it builds, else the reference."""
    if device.type == "cpu" and cpu_kernels.cpu_kernels_available():
        return CpuPagedAttention
    return TorchPagedAttention


class Attention(nn.Module):
    """Paged attention of one layer. The runner binds k_cache/v_cache after allocating KV memory."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: type[TorchPagedAttention] = TorchPagedAttention  # the runner picks the device's best
        self.workspace: GatherWorkspace | None = None  # bound by the runner, shared by all layers
        self.kv_scales: KVScales | None = None  # a quantized cache's scales (kv_quant.py), bound by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(self.k_cache, self.v_cache, k, v, batch, self.kv_scales)
        out = self.backend.forward(q, self.k_cache, self.v_cache, batch, self.scale, self.sliding_window, self.workspace, self.kv_scales)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def plain_decode_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: BatchInputs,
                         group: AttentionGroup) -> torch.Tensor:
        """Rotary on q and k, then plain_decode, in one op (decode_attention_block, paged_attention.cpp): qkv [T, (H +
        2 Hkv) D], the fused projection's output (its q and k rotated in place) -> [T, H*D]; the same kernels, so the
        same numbers as apply_rotary then plain_decode."""
        scales = self.kv_scales
        token_rows, positions = group.decode_rows_and_positions()
        return torch.ops.tokenmill_cpu.decode_attention_block.default(
            qkv, self.num_heads, self.num_kv_heads, cos, sin, self.k_cache, self.v_cache, None if scales is None else scales.k,
            None if scales is None else scales.v, batch.slot_mapping, token_rows, group.block_table, positions, self.sliding_window or 0,
            self.scale, group.tree_start, group.tree_mask,
        )

    def plain_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: BatchInputs, group: AttentionGroup) -> torch.Tensor:
        """forward on the CPU kernels for a batch of plain decodes (BatchInputs.plain_decode_group) whose q and k
        were rotated already (q/k norms first: Qwen3): q [T, H, D], k/v [T, Hkv, D] -> [T, H*D], the CPU
        backend's write and decode without forward's dispatch over groups."""
        CpuPagedAttention.write_kv(self.k_cache, self.v_cache, k, v, batch, self.kv_scales)
        out = q.new_empty(q.shape)
        CpuPagedAttention.decode(q, self.k_cache, self.v_cache, group, out, self.scale, self.sliding_window, None, self.kv_scales)
        return out.view(q.shape[0], -1)
