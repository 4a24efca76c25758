"""The tiled prompt-chunk attention kernel (cpu/prefill_attention.cpp) against plain PyTorch.

The reference gathers each chunk's context out of the paged cache and runs SDPA with an explicit
causal (and sliding-window) mask, in float32. The kernel must match it for chunks that start
anywhere (0, inside a block, on a block boundary), of any length (1 included), for GQA ratios that
fill the vector lanes differently, head sizes that take the vector (64, 128) and scalar (24 on
AVX-512, 4 everywhere) paths, with block tables in random order and batches of mixed chunks.
Then end to end: greedy tokens with chunked prefill and prefix caching equal the reference backend's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="CPU kernels did not build")

# float32: sums of a few hundred products in another order; bf16 / fp16: the output's own rounding
# (the kernel accumulates in float32 from the same rounded inputs as the float32 reference).
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_case(chunks, num_kv_heads, group, head_dim, dtype, block=16, seed=0):
    """Random paged caches holding each request's context up to its chunk's end, a random block table
    per request, and q for the chunks' tokens (one extra row at the end that no chunk owns)."""
    g = torch.Generator().manual_seed(seed)
    ends = [start + n for start, n in chunks]
    need = sum(-(-e // block) for e in ends)
    num_blocks = need + 5
    k_cache = torch.randn(num_kv_heads, num_blocks, block, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block, head_dim, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-e // block))] for e in ends]
    width = max(map(len, tables)) + 1  # a spare column of null blocks, as the runner pads
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    num_tokens = sum(n for _, n in chunks)
    q = torch.randn(num_tokens + 1, num_kv_heads * group, head_dim, generator=g).to(dtype)
    lens = torch.tensor([n for _, n in chunks])
    first_rows = torch.cumsum(lens, 0) - lens
    starts = torch.tensor([s for s, _ in chunks])
    return q, k_cache, v_cache, block_table, first_rows, starts, lens


def reference(q, k_cache, v_cache, block_table, first_rows, starts, lens, window, scale):
    """Gathered context + explicit mask SDPA, float32, per request."""
    num_kv_heads, _, block, head_dim = k_cache.shape
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(len(lens)):
        s, n, r = int(starts[b]), int(lens[b]), int(first_rows[b])
        ctx = s + n
        blocks = block_table[b, : -(-ctx // block)]
        k = k_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float()
        v = v_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float()
        qpos = torch.arange(s, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q[r : r + n].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[r : r + n] = o.transpose(0, 1)
    return out


def run_kernel(q, k_cache, v_cache, block_table, first_rows, starts, lens, window, scale, rows_per_task=0):
    out = torch.full_like(q, 7.0)
    cpu.paged_prefill_attention(out, q, k_cache, v_cache, first_rows, starts, lens, block_table, window, scale, rows_per_task)
    return out


def check(chunks, num_kv_heads, group, head_dim, dtype, window=None, rows_per_task=0, seed=0):
    q, k_cache, v_cache, table, first_rows, starts, lens = make_case(chunks, num_kv_heads, group, head_dim, dtype, seed=seed)
    scale = head_dim**-0.5
    got = run_kernel(q, k_cache, v_cache, table, first_rows, starts, lens, window, scale, rows_per_task)
    want = reference(q, k_cache, v_cache, table, first_rows, starts, lens, window, scale)
    n = int(lens.sum())
    assert (got[n:] == 7).all()  # rows no chunk owns are untouched
    torch.testing.assert_close(got[:n].float(), want[:n].to(dtype).float(), **TOL[dtype])


# (start, length): from 0, inside a block, on a block boundary, length 1, longer than a task's rows,
# a tail of a few rows, a long context before a short chunk.
CHUNKS = [(0, 37), (5, 1), (16, 20), (19, 70), (0, 1), (100, 3), (300, 45)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(dtype, group, head_dim):
    check(CHUNKS, 2, group, head_dim, dtype, seed=group * 1000 + head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_sliding_window(dtype, window):
    check(CHUNKS, 2, 3, 64, dtype, window=window, seed=window)


# 4: scalar everywhere; 24: AVX2-only vectors; 40: neither width divides; 48: AVX-512 vectors, but no
# whole 32-element bf16 pairs of vectors (float32 tiles); 96: bf16 pairs (with AVX512-BF16).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [4, 24, 40, 48, 96])
@pytest.mark.parametrize("window", [None, 9])
def test_other_head_sizes(head_dim, window, dtype):
    check(CHUNKS, 2, 3, head_dim, dtype, window=window, seed=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_task", [1, 5, 8, 17, 200])  # tiles of one position up to whole chunks
@pytest.mark.parametrize("group", [1, 3, 9])
def test_task_tiling(rows_per_task, group, dtype):
    check([(0, 50), (33, 64), (7, 2)], 1, group, 64, dtype, rows_per_task=rows_per_task, seed=rows_per_task + group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 5, 6, 7, 9, 12])  # default tasks on AVX-512: 32, 16, 8, 16, 7 (one by one), 4 positions
def test_default_tiling_other_groups(group, dtype):
    check([(0, 50), (33, 64), (7, 2), (300, 45)], 1, group, 64, dtype, seed=group)


@pytest.mark.parametrize("block", [1, 16, 32])
def test_block_sizes(block):
    q, k_cache, v_cache, table, first_rows, starts, lens = make_case([(0, 9), (40, 40), (3, 70)], 3, 3, 64, torch.float32, block=block)
    got = run_kernel(q, k_cache, v_cache, table, first_rows, starts, lens, None, 0.125)
    want = reference(q, k_cache, v_cache, table, first_rows, starts, lens, None, 0.125)
    torch.testing.assert_close(got[:-1], want[:-1], **TOL[torch.float32])


def test_strided_q():
    """q as the runner hands it: a view into the fused QKV projection's rows (a row stride > H * D)."""
    q, k_cache, v_cache, table, first_rows, starts, lens = make_case(CHUNKS, 2, 3, 64, torch.float32)
    wide = torch.randn(q.shape[0], q.shape[1] + 4, 64)
    wide[:, : q.shape[1]] = q
    strided = wide[:, : q.shape[1]]
    assert not strided.is_contiguous()
    got = run_kernel(strided, k_cache, v_cache, table, first_rows, starts, lens, None, 0.125)
    torch.testing.assert_close(got, run_kernel(q, k_cache, v_cache, table, first_rows, starts, lens, None, 0.125), atol=0, rtol=0)


def test_bad_input_is_refused():
    q, k_cache, v_cache, table, first_rows, starts, lens = make_case([(0, 9), (40, 4)], 1, 1, 64, torch.float32)
    with pytest.raises(RuntimeError, match="context longer than its block table"):
        run_kernel(q, k_cache, v_cache, table, first_rows, starts + 1000, lens, None, 0.125)
    with pytest.raises(RuntimeError, match="rows out of range"):
        run_kernel(q, k_cache, v_cache, table, first_rows + 100, starts, lens, None, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        run_kernel(q.bfloat16(), k_cache, v_cache, table, first_rows, starts, lens, None, 0.125)


# -- end to end on tiny models -----------------------------------------------------------------------


def _greedy_runs(path, prompts, **engine_args):
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", enable_prefix_caching=True, num_kv_blocks=256, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    # Together (shared prefix computed once, then the suffixes' chunks after it), then one at a time
    # (each finds the prefix cached: its first chunk starts after the hit).
    runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)])
    for p in prompts:
        runs.append(llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids)
    return llm, runs


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa"])
@pytest.mark.parametrize("engine_args", [dict(block_size=8, max_num_batched_tokens=24), dict(block_size=4, max_num_batched_tokens=7)],
                         ids=["bs8-chunk24", "bs4-chunk7"])
def test_greedy_equals_reference_backend(name, engine_args, tiny_model_factory, monkeypatch):
    """Chunked prefill and prefix caching: the CPU backend with the kernel gives the reference backend's tokens."""
    import random

    path = tiny_model_factory(name)
    rng = random.Random(5)
    prefix = [rng.randrange(500) for _ in range(45)]
    prompts = [prefix + [rng.randrange(500) for _ in range(n)] for n in (1, 9, 30, 61)] + [[rng.randrange(500) for _ in range(50)]]

    calls = []
    kernel = cpu.paged_prefill_attention

    def counting(out, q, k_cache, v_cache, first_rows, starts, lens, *args, **kwargs):
        calls.append((starts.tolist(), lens.tolist()))
        kernel(out, q, k_cache, v_cache, first_rows, starts, lens, *args, **kwargs)

    monkeypatch.setattr(cpu, "paged_prefill_attention", counting)
    llm, got = _greedy_runs(path, prompts, **engine_args)
    assert llm.llm_engine.executor.driver_runner.attn_layers[0].backend.__name__ == "CpuPagedAttention"
    assert any(s > 0 and n > 1 for starts, lens in calls for s, n in zip(starts, lens))  # chunks after position 0 ran in it
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    del llm

    monkeypatch.undo()
    monkeypatch.setattr(cpu, "cpu_kernels_available", lambda: False)
    ref_llm, want = _greedy_runs(path, prompts, **engine_args)
    assert ref_llm.llm_engine.executor.driver_runner.attn_layers[0].backend.__name__ == "TorchPagedAttention"
    assert got == want
