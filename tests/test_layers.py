"""Kernels against plain PyTorch references: paged attention over a head-major paged cache (the
torch backend: decodes as batched matmuls, prompt chunks through SDPA; the CPU backend: decodes in
tokenmill's C++ kernel, with and without AVX-512 head sizes), and the prepacked CPU bf16 linear."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill.config import cpu_has_native_bf16, resolve_dtype
from tokenmill.engine.messages import ScheduledChunk
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.cpu import cpu_kernels_available
from tokenmill.layers.attention import Attention, CpuPagedAttention, TorchPagedAttention
from tokenmill.layers.quantization import PackedCPUWeight, cpu_packed_weights_supported
from tokenmill.layers.quantization.unquantized import bucketed_rows, unpadded_head
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.batch import build_batch_inputs

BLOCK = 4


def reference_attention(q, k, v, num_kv_heads: int, start: int, scale: float, window: int | None) -> torch.Tensor:
    """One request, contiguous K/V for all its positions so far: [T, H, D] queries at start..start+T-1."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).float()  # [ctx, H, D]
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("thd,chd->htc", q.float(), k) * scale
    q_pos = torch.arange(start, start + num_q)[:, None]
    kv_pos = torch.arange(k.shape[0])[None, :]
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed &= kv_pos > q_pos - window
    scores = scores.masked_fill(~allowed[None], -math.inf)
    return torch.einsum("htc,chd->thd", scores.softmax(-1), v)


BACKENDS = [
    TorchPagedAttention,
    pytest.param(CpuPagedAttention, marks=pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels did not build")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [8, 64])  # 64: the kernel's 16-lane path; 8: its scalar loops
@pytest.mark.parametrize(
    "shapes",
    [
        # (context already cached, new tokens this step): decodes, a first prompt chunk, later chunks.
        [(7, 1), (12, 1), (0, 9), (5, 6), (1, 1), (16, 3)],
        # prompt chunks that all start at 0 (SDPA's own causal mask), one of them padded
        [(0, 9), (0, 7), (3, 1)],
    ],
    ids=["mixed", "from-start"],
)
def test_paged_attention_matches_reference(backend, dtype, tol, num_kv_heads, window, head_dim, shapes):
    torch.manual_seed(0)
    num_heads, num_blocks = 4, 40
    attn = Attention(num_heads, head_dim, num_kv_heads, head_dim**-0.5, sliding_window=window)
    attn.backend = backend
    attn.k_cache = torch.zeros(num_kv_heads, num_blocks, BLOCK, head_dim, dtype=dtype)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    blocks = iter(torch.randperm(num_blocks - 1) + 1)  # block 0 is the null block
    history, chunks = [], []
    for i, (cached, new) in enumerate(shapes):
        n = cached + new
        table = [int(next(blocks)) for _ in range(-(-n // BLOCK))]
        k_all = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        v_all = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        for pos in range(cached):  # what earlier steps wrote
            attn.k_cache[:, table[pos // BLOCK], pos % BLOCK] = k_all[pos]
            attn.v_cache[:, table[pos // BLOCK], pos % BLOCK] = v_all[pos]
        history.append((k_all, v_all, cached, new))
        chunks.append(ScheduledChunk(f"r{i}", list(range(new)), cached, table, True, SamplingParams(), 0, 0))
    batch = build_batch_inputs(chunks, BLOCK, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, num_heads, head_dim).to(dtype)
    k_new = torch.cat([k[c:] for k, _, c, _ in history])
    v_new = torch.cat([v[c:] for _, v, c, _ in history])
    out = attn(q.flatten(1), k_new.flatten(1), v_new.flatten(1), batch).view(-1, num_heads, head_dim)
    row = 0
    for k_all, v_all, cached, new in history:
        want = reference_attention(q[row : row + new], k_all, v_all, num_kv_heads, cached, head_dim**-0.5, window)
        torch.testing.assert_close(out[row : row + new].float(), want, atol=tol, rtol=tol)
        row += new


@pytest.mark.skipif(not cpu_packed_weights_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 here")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_cpu_linear_matches_f_linear(rows, bias):
    torch.manual_seed(0)
    weight = torch.randn(96, 40).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    x = torch.randn(2, rows, 40).bfloat16()
    want = F.linear(x.float(), weight.float(), b.float() if b is not None else None)
    got = PackedCPUWeight(weight)(x, b)
    assert got.shape == (2, rows, 96) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=2e-2)


@pytest.mark.skipif(not (cpu_kernels_available() and cpu_packed_weights_supported(torch.device("cpu"), torch.bfloat16)),
                    reason="no CPU kernels or no oneDNN bf16 here")
def test_packed_cpu_linear_decode_rows_run_dense_linear(monkeypatch):
    """A decode step's rows (up to decode_max_rows: 8, or 64 in bf16 where dense_linear multiplies pairs)
    read dense_linear's copy of the weight, 2-D or not; more rows read oneDNN's packed one; both give
    F.linear's numbers. The copy is kept up to DECODE_COPY_MAX_BYTES."""
    import tokenmill.layers.quantization.unquantized as unquantized

    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        torch.manual_seed(0)
        weight, b = torch.randn(96, 40).to(dtype), torch.randn(96).to(dtype)
        packed = PackedCPUWeight(weight)
        assert packed.decode_packed is not None
        max_rows = unquantized.decode_max_rows(dtype)
        assert max_rows == (unquantized.DECODE_MAX_ROWS_PAIRED_BF16 if dtype == torch.bfloat16 and cpu_kernels.bf16_pairs()
                            else unquantized.DECODE_MAX_ROWS)
        calls = []
        monkeypatch.setattr(packed, "_dense", lambda *args: calls.append(len(args[0])) or torch.ops.tokenmill_cpu.dense_linear(*args))
        for rows in [*range(1, 10), max_rows - 1, max_rows, max_rows + 1, max_rows + 2]:
            x = torch.randn(rows, 40).to(dtype)
            want = F.linear(x.float(), weight.float(), b.float())
            torch.testing.assert_close(packed(x, b).float(), want, atol=tol * 5, rtol=tol)
            torch.testing.assert_close(packed(x.view(1, rows, 40), b).float(), want.view(1, rows, 96), atol=tol * 5, rtol=tol)
        assert calls == [rows for rows in [*range(1, 10), max_rows - 1, max_rows, max_rows + 1, max_rows + 2]
                         for _ in range(2) if rows <= max_rows]
    monkeypatch.setenv(unquantized.DECODE_COPIES_ENV, "0")
    assert PackedCPUWeight(weight).decode_packed is None  # turned off
    monkeypatch.delenv(unquantized.DECODE_COPIES_ENV)
    monkeypatch.setattr(unquantized, "DECODE_COPY_MAX_BYTES", weight.numel() * weight.element_size() - 1)
    assert PackedCPUWeight(weight).decode_packed is None  # a larger weight keeps only oneDNN's copy


@pytest.mark.skipif(not (cpu_kernels_available() and cpu_packed_weights_supported(torch.device("cpu"), torch.bfloat16)),
                    reason="no CPU kernels or no oneDNN bf16 here")
def test_packed_cpu_lm_head_keeps_dense_linear_copy_alone_where_bf16_pairs(monkeypatch):
    """An LM head (dense_only) in bf16 with vdpbf16ps pairs keeps dense_linear's layout only and takes it at
    every row count, with F.linear's numbers; in float32, without pairs or with the copies turned off it is
    an ordinary PackedCPUWeight (oneDNN's copy, dense_linear's up to decode_max_rows)."""
    import tokenmill.layers.quantization.unquantized as unquantized

    torch.manual_seed(0)
    weight = torch.randn(200, 48).bfloat16()
    head = PackedCPUWeight(weight, dense_only=True)
    if not cpu_kernels.bf16_pairs():
        assert head.packed is not None
        return
    assert head.packed is None and head.decode_packed is not None
    for rows in (1, 7, 33, 300):
        x = torch.randn(rows, 48).bfloat16()
        torch.testing.assert_close(head(x).float(), F.linear(x.float(), weight.float()), atol=0.1, rtol=2e-2)
    assert PackedCPUWeight(weight.float(), dense_only=True).packed is not None
    monkeypatch.setenv(unquantized.DECODE_COPIES_ENV, "0")
    off = PackedCPUWeight(weight, dense_only=True)
    assert off.packed is not None and off.decode_packed is None


@pytest.mark.parametrize("rows", [5, 9, 33, 130])  # 1 x rows rows: unpadded, and padded to 16, 40 and 160
def test_packed_cpu_linear_float32_pads_rows_to_buckets(rows):
    torch.manual_seed(0)
    weight, b, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    got = PackedCPUWeight(weight)(x, b)
    assert got.shape == (rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


def test_bucketed_rows_bound_the_shapes_and_the_padding():
    buckets = {bucketed_rows(rows) for rows in range(1, 8193)}
    assert len(buckets) <= 48  # a few dozen oneDNN kernels per weight, whatever the traffic
    assert all(rows <= bucketed_rows(rows) <= max(rows * 1.25, rows + 7) for rows in range(1, 8193))
    assert [bucketed_rows(r) for r in (1, 8, 9, 33, 64, 65, 2048)] == [1, 8, 16, 40, 64, 80, 2048]


def test_large_matmuls_split_where_their_bucket_pads_much():
    """From SPLIT_MIN_ROWS rows, a row count its bucket pads by more than a twelfth runs as the largest
    bucket below it plus the rest: no new shapes (both pieces are buckets) and at most a twelfth of padding."""
    assert [unpadded_head(r) for r in (100, 300, 1056, 1300, 2017, 2049, 3072)] == [0, 0, 1024, 1280, 0, 2048, 0]
    for rows in range(256, 8193):
        head = unpadded_head(rows)
        pieces = [head, bucketed_rows(rows - head)] if head else [bucketed_rows(rows)]
        assert all(bucketed_rows(p) == p for p in pieces)
        assert sum(pieces) - rows <= rows // 12


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [300, 1056, 1300])
def test_packed_cpu_linear_split_rows_match_f_linear(rows, dtype, tol):
    if not cpu_packed_weights_supported(torch.device("cpu"), dtype):
        pytest.skip(f"no oneDNN {dtype} here")
    torch.manual_seed(0)
    weight, b = torch.randn(48, 40).to(dtype), torch.randn(48).to(dtype)
    x = torch.randn(rows, 40).to(dtype)
    want = F.linear(x.float(), weight.float(), b.float())
    torch.testing.assert_close(PackedCPUWeight(weight)(x, b).float(), want, atol=tol * 5, rtol=tol)


def test_auto_dtype_on_cpu_follows_native_bf16():
    cpu = torch.device("cpu")
    want = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", cpu, torch.float16) == want
    assert resolve_dtype("float32", cpu, None) == torch.float32


@pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels did not build")
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1000, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_argmax_logsumexp_matches_torch(vocab, dtype):
    """Half-precision logits give exactly what their float32 widening gives."""
    from tokenmill.kernels.cpu import argmax_logsumexp

    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab) * 5
    logits[1] = logits[1].max() + 1  # a row of ties: the first index wins, as torch.argmax
    logits[2] = float("-inf")  # a fully masked row (grammar): index 0, logsumexp -inf
    logits[3, -1] = logits[3].max() + 2  # the maximum in the scalar tail
    logits[4, vocab // 2 :] = float("-inf")
    logits = logits.to(dtype).float()  # values the dtype holds exactly
    ids, lse = argmax_logsumexp(logits.to(dtype))
    assert torch.equal(ids, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))
    assert torch.equal(lse, argmax_logsumexp(logits)[1])


# -- the fused pointwise CPU ops against the eager torch code they replace --------------------------

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels did not build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def one_ulp(dtype):
    return dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_rms_norm_and_residual_add_match_torch(dtype):
    from tokenmill.layers.norm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96).to(dtype)
    x = torch.randn(7, 96).to(dtype)
    residual = torch.randn(7, 96).to(dtype)
    # The sum of squares is accumulated in another order: float32 may differ in the last bits.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else one_ulp(dtype)
    torch.testing.assert_close(norm(x), norm._torch_forward(x), **tol)
    want_residual = residual + x
    out, new_residual = norm(x, residual.clone())
    assert torch.equal(new_residual, want_residual)  # the residual add rounds exactly as torch's
    torch.testing.assert_close(out, norm._torch_forward(want_residual), **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_silu_and_mul_matches_torch(dtype):
    from tokenmill.layers.activation import SiluAndMul

    torch.manual_seed(0)
    x = (torch.randn(5, 2 * 40) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, **(dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else one_ulp(dtype)))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: halves of whole 16-lane chunks; 16: the scalar loop
def test_cpu_rotary_matches_torch_exactly(dtype, head_dim):
    """On strided q/k views of a fused qkv output, as the model passes them: bit-equal results."""
    from tokenmill.layers.rotary import apply_rotary, rotate_half

    torch.manual_seed(0)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = torch.randn(tokens, head_dim).to(dtype), torch.randn(tokens, head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    got_q, got_k = apply_rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
