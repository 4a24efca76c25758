"""Cascade attention for decodes over a shared prefix (cpu/prefill_attention.cpp's cascade_prefix_attention,
merged in cpu/paged_attention.cpp's decode kernel) against plain PyTorch, the batch builder's detection of
the shared prefix, and greedy equality end to end with cascade on and off.

The kernel tests are named `*cascade_kernel*`: tests/test_kernel_isa.py runs them on the AVX2, AVX-512 and
scalar builds too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.kernels import cpu
from tokenmill.layers.kv_quant import quantize

kernels = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="CPU kernels did not build")

# float32: sums in another order and the merge's two exponentials; bf16 / fp16: the output's own rounding
# (the kernel accumulates in float32 from the same rounded inputs as the float32 reference).
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_case(positions, shared_blocks, num_kv_heads, group, head_dim, dtype, block=16, seed=0):
    """Random caches; every request's table starts with the same `shared_blocks` physical blocks, then
    blocks of its own up to its position; q holds one decode token per request, in a shuffled order
    among spare rows (as decode rows of a mixed step)."""
    g = torch.Generator().manual_seed(seed)
    own = [-(-(p + 1) // block) - shared_blocks for p in positions]
    num_blocks = 1 + shared_blocks + sum(own) + 3
    k_cache = torch.randn(num_kv_heads, num_blocks, block, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block, head_dim, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    shared = [perm.pop() for _ in range(shared_blocks)]
    tables = [shared + [perm.pop() for _ in range(n)] for n in own]
    width = max(map(len, tables)) + 1
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    num_rows = len(positions) + 3
    q = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=g).to(dtype)
    token_rows = torch.randperm(num_rows, generator=g)[: len(positions)]
    return q, k_cache, v_cache, block_table, token_rows, torch.tensor(positions), torch.tensor(shared)


def reference(q, k_cache, v_cache, block_table, token_rows, positions, scale):
    """Each decode token over its whole gathered context, float32."""
    num_kv_heads, _, block, head_dim = k_cache.shape
    out = torch.zeros(len(token_rows), q.shape[1], head_dim)
    for b, (row, pos) in enumerate(zip(token_rows.tolist(), positions.tolist())):
        ctx = pos + 1
        blocks = block_table[b, : -(-ctx // block)]
        k = k_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float()
        v = v_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float()
        qh = q[row].float().view(num_kv_heads, -1, head_dim)
        p = torch.softmax(qh @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ v).reshape(-1, head_dim)
    return out


def run_cascade(q, k_cache, v_cache, block_table, token_rows, positions, shared, prefix_len, scale, scales=(None, None), rows_per_task=0):
    out = torch.full_like(q, 7.0)
    o, lse = cpu.cascade_prefix_attention(q, k_cache, v_cache, token_rows, shared, prefix_len, scale, *scales, rows_per_task)
    cpu.paged_decode_attention(out, q, k_cache, v_cache, token_rows, block_table, positions, None, scale, *scales, prefix=(prefix_len, o, lse))
    return out, o, lse


POSITIONS = [40, 33, 95, 32, 64, 47, 200, 51, 36]  # all after a 2-block (32-token) shared prefix; 64: a suffix on a block edge


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cascade_kernel_matches_reference(dtype, group, head_dim):
    q, kc, vc, table, rows, pos, shared = make_case(POSITIONS, 2, 2, group, head_dim, dtype, seed=group * 100 + head_dim)
    scale = head_dim**-0.5
    got, _, _ = run_cascade(q, kc, vc, table, rows, pos, shared, 32, scale)
    want = reference(q, kc, vc, table, rows, pos, scale)
    torch.testing.assert_close(got[rows].float(), want.to(dtype).float(), **TOL[dtype])
    spare = torch.ones(q.shape[0], dtype=torch.bool)
    spare[rows] = False
    assert (got[spare] == 7).all()  # rows that are no decode token are untouched


@kernels
@pytest.mark.parametrize("prefix_len", [1, 17, 32])  # inside the first block, mid-block, the shared blocks' end
@pytest.mark.parametrize("head_dim", [4, 24, 40, 64])  # scalar everywhere; AVX2-only vectors; neither width; both
def test_cascade_kernel_prefix_lengths_and_head_sizes(prefix_len, head_dim):
    q, kc, vc, table, rows, pos, shared = make_case(POSITIONS, 2, 2, 3, head_dim, torch.float32, seed=prefix_len + head_dim)
    got, o, lse = run_cascade(q, kc, vc, table, rows, pos, shared, prefix_len, 0.3)
    torch.testing.assert_close(got[rows], reference(q, kc, vc, table, rows, pos, 0.3), **TOL[torch.float32])
    # The prefix pass alone: attention over positions 0 .. prefix_len - 1 and its log-sum-exp.
    k = kc[:, shared].reshape(2, -1, head_dim)[:, :prefix_len]
    v = vc[:, shared].reshape(2, -1, head_dim)[:, :prefix_len]
    s = torch.einsum("bhgd,hkd->bhgk", q[rows].view(len(rows), 2, 3, head_dim), k) * 0.3
    torch.testing.assert_close(lse, s.logsumexp(-1).reshape(len(rows), 6), **TOL[torch.float32])
    torch.testing.assert_close(o, torch.einsum("bhgk,hkd->bhgd", s.softmax(-1), v).reshape(len(rows), 6, head_dim), **TOL[torch.float32])


@kernels
@pytest.mark.parametrize("rows_per_task", [1, 5, 64, 1000])  # one request per task up to all of them
@pytest.mark.parametrize("block", [1, 8, 32])
def test_cascade_kernel_tiling_and_block_sizes(rows_per_task, block):
    positions = [p + 64 for p in POSITIONS] * 3
    q, kc, vc, table, rows, pos, shared = make_case(positions, 64 // block, 1, 3, 64, torch.float32, block=block, seed=block)
    got, _, _ = run_cascade(q, kc, vc, table, rows, pos, shared, 64, 0.125, rows_per_task=rows_per_task)
    torch.testing.assert_close(got[rows], reference(q, kc, vc, table, rows, pos, 0.125), **TOL[torch.float32])


@kernels
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_kernel_quantized_cache_matches_plain_decode(kv_dtype, dtype):
    """Over an int8 / fp8 cache, cascade gives what the plain decode kernel gives on the same cache."""
    q, kc, vc, table, rows, pos, shared = make_case(POSITIONS, 2, 2, 3, 64, dtype, seed=7)
    caches, scales = [], []
    for cache in (kc, vc):
        scale = torch.ones(1) if kv_dtype != torch.int8 else None
        values, row_scales = quantize(cache.reshape(-1, 64), kv_dtype, scale)
        caches.append(values.view(cache.shape))
        scales.append(row_scales.view(cache.shape[:3]) if kv_dtype == torch.int8 else scale)
    got, _, _ = run_cascade(q, *caches, table, rows, pos, shared, 32, 0.125, tuple(scales))
    want = torch.full_like(q, 7.0)
    cpu.paged_decode_attention(want, q, *caches, rows, table, pos, None, 0.125, *scales)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@kernels
def test_cascade_kernel_bad_input_is_refused():
    q, kc, vc, table, rows, pos, shared = make_case(POSITIONS, 2, 1, 1, 64, torch.float32)
    o, lse = cpu.cascade_prefix_attention(q, kc, vc, rows, shared, 32, 0.125)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="must come after the shared prefix"):
        cpu.paged_decode_attention(out, q, kc, vc, rows, table, pos - 20, None, 0.125, prefix=(32, o, lse))
    with pytest.raises(RuntimeError, match="sliding window"):
        cpu.paged_decode_attention(out, q, kc, vc, rows, table, pos, 16, 0.125, prefix=(32, o, lse))
    with pytest.raises(RuntimeError, match="prefix_o"):
        cpu.paged_decode_attention(out, q, kc, vc, rows, table, pos, None, 0.125, prefix=(32, o[:1], lse))
    with pytest.raises(RuntimeError, match="prefix_len must be"):
        cpu.cascade_prefix_attention(q, kc, vc, rows, shared, 33, 0.125)
    with pytest.raises(RuntimeError, match="block out of range"):
        cpu.cascade_prefix_attention(q, kc, vc, rows, shared + 1000, 32, 0.125)


# -- the batch builder's detection -------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, positions, want",
    [
        ([[5, 6, 7, 8, 9]] * 8, [70] * 8, 4),  # all alike: whole blocks before the least position (70 // 16 = 4)
        ([[5, 6, 7, 8, 9]] * 7 + [[5, 6, 3, 8, 9]], [70] * 8, 2),  # one row differs from the third block on
        ([[5, 6, 7, 8, 9]] * 7 + [[4, 6, 7, 8, 9]], [70] * 8, 0),  # the first blocks differ: nothing shared
        ([[5, 6, 7, 8, 9]] * 7, [70] * 7, 0),  # too few rows
        ([[5, 6, 7, 8, 9]] * 8, [70] * 7 + [40], 2),  # a row at position 40: only blocks 0, 1 lie before it
        ([[5, 6, 7, 8, 9]] * 8, [70] * 7 + [31], 0),  # ... and a row at 31: one block, under the minimum
    ],
)
def test_shared_prefix_blocks(rows, positions, want, monkeypatch):
    from tokenmill.worker import batch

    monkeypatch.setattr(batch, "CASCADE_MIN_PREFIX_TOKENS", 32)
    monkeypatch.setattr(batch, "CASCADE_MIN_ROWS", 8)
    assert batch.shared_prefix_blocks(np.array(rows), np.array(positions), 16) == want


# -- end to end on tiny models -----------------------------------------------------------------------


def _greedy(path, prompts, dtype, **engine_args):
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, enable_prefix_caching=True, num_kv_blocks=256, block_size=8, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@kernels
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa"])  # mistral_swa: a sliding window, which keeps the plain path
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_equal_with_cascade_on_and_off(name, kv_cache_dtype, tiny_model_factory, monkeypatch):
    """A batch sharing a long prefix decodes to the same tokens with cascade attention as without it."""
    import random

    from tokenmill.worker import batch

    monkeypatch.setattr(batch, "CASCADE_MIN_PREFIX_TOKENS", 32)  # the tiny models' short contexts and small batch take it too
    monkeypatch.setattr(batch, "CASCADE_MIN_ROWS", 8)
    path = tiny_model_factory(name)
    rng = random.Random(3)
    prefix = [rng.randrange(500) for _ in range(61)]
    prompts = [prefix + [rng.randrange(500) for _ in range(n)] for n in (1, 4, 9, 16, 23, 30, 2, 7, 40)]
    calls = []
    kernel = cpu.cascade_prefix_attention
    monkeypatch.setattr(cpu, "cascade_prefix_attention", lambda *a, **k: calls.append(a[5]) or kernel(*a, **k))
    got = _greedy(path, prompts, "float32", kv_cache_dtype=kv_cache_dtype)
    assert (len(calls) > 0) == (name == "llama_gqa") and all(n == 56 for n in calls)  # 7 whole shared blocks of 8
    calls.clear()
    want = _greedy(path, prompts, "float32", kv_cache_dtype=kv_cache_dtype, cascade_attention=False)
    assert not calls
    assert got == want


def test_cli_flag_turns_it_off():
    from tokenmill.entrypoints.cli import build_parser, engine_config_from_args

    for flags, want in (([], True), (["--no-cascade-attention"], False)):
        args = build_parser().parse_args(["bench", "throughput", *flags])
        assert engine_config_from_args(args).cache.cascade_attention is want


@kernels
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_equal_with_cascade_on_and_off(dtype):
    """SmolLM2-135M, 8 requests over a 300-token shared prefix (over the 256-token threshold; 8 rows allowed).

    float32: the same tokens. bf16: the outputs round differently (the prefix and the rest are summed in
    float32 apart, then merged), so greedy paths may part after a near tie; most of them must not."""
    import random

    from conftest import smollm2_gguf_path

    from tokenmill.worker import batch

    if smollm2_gguf_path() is None:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")
    rng = random.Random(11)
    prefix = [rng.randrange(1000, 40000) for _ in range(300)]
    prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(n)] for n in (3, 8, 13, 21, 5, 17, 30, 2)]
    calls = []
    kernel = cpu.cascade_prefix_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch, "CASCADE_MIN_ROWS", 8)
        mp.setattr(cpu, "cascade_prefix_attention", lambda *a, **k: calls.append(a[5]) or kernel(*a, **k))
        got = _greedy(None, prompts, dtype)
    assert calls and all(n == 296 for n in calls)  # 37 whole blocks of 8
    want = _greedy(None, prompts, dtype, cascade_attention=False)
    if dtype == "float32":
        assert got == want
    else:
        assert sum(g == w for g, w in zip(got, want)) >= 6, (got, want)
