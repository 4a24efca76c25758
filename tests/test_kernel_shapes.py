"""tokenmill's CPU kernels on the shapes that pick their code paths, against plain PyTorch.

The kernels run a vector at a time (16 lanes with AVX-512, 8 with AVX2: cpu/vec.h) and scalar
loops for what is left; these shapes put rows, heads and vocabularies on both sides of both widths,
and the query heads per KV head across the fixed-size attention passes (1 to 8) and past them.
tests/test_kernel_isa.py runs this file against builds for each ISA; alone, it tests the build
for this machine. Rotary and the residual add must be bit-equal to the eager ops on every ISA.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="CPU kernels did not build")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EXPECT_ISA_ENV = "TOKENMILL_EXPECT_VECTOR_ISA"  # set by test_kernel_isa.py for the build it asked for


def _native_isa() -> str:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"


def test_vector_isa_is_the_one_built_for():
    """The build runs the vector code its target has: a -march=native build on an AVX2 machine
    must not fall back to the scalar loops."""
    want = os.environ.get(EXPECT_ISA_ENV)
    if want is None:
        if os.environ.get(cpu.MARCH_ENV, "native") not in ("", "native"):
            pytest.skip(f"{cpu.MARCH_ENV} is set without {EXPECT_ISA_ENV}")
        if not Path("/proc/cpuinfo").exists():
            pytest.skip("no /proc/cpuinfo to say what native is")
        want = _native_isa()
    assert cpu.vector_isa() == want


def _tol(dtype):
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}[dtype]


# (head_dim, query heads per KV head): 64 and 128 take the fixed-size passes for G <= 8, and the
# generic vector loops for G = 9; 24 and 40 are whole AVX2 vectors but not AVX-512 ones; 4 is scalar.
ATTN_SHAPES = [(64, 1), (64, 3), (64, 8), (64, 9), (128, 2), (128, 7), (24, 3), (40, 2), (4, 2), (256, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", ATTN_SHAPES, ids=[f"D{d}-G{g}" for d, g in ATTN_SHAPES])
@pytest.mark.parametrize("window", [None, 7])
def test_write_kv_and_paged_decode_attention(dtype, head_dim, group, window):
    torch.manual_seed(head_dim * 100 + group)
    num_kv_heads, block, num_blocks = 2, 16, 48
    contexts = [1, 5, 16, 17, 40, 131]  # within a block, a whole block, across blocks, a long one
    B = len(contexts)
    k_cache = torch.zeros(num_kv_heads, num_blocks, block, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0: the null block
    tables = [[free.pop() for _ in range(-(-n // block))] for n in contexts]
    max_blocks = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    k_all = [torch.randn(n, num_kv_heads, head_dim).to(dtype) for n in contexts]
    v_all = [torch.randn(n, num_kv_heads, head_dim).to(dtype) for n in contexts]
    slots = torch.tensor([tables[b][p // block] * block + p % block for b, n in enumerate(contexts) for p in range(n)])
    # K/V of every position through write_kv, as prompt chunks and decodes write them.
    cpu.write_kv(k_cache, v_cache, torch.cat(k_all), torch.cat(v_all), slots)
    flat_k, flat_v = k_cache.view(num_kv_heads, -1, head_dim), v_cache.view(num_kv_heads, -1, head_dim)
    assert torch.equal(flat_k[:, slots].transpose(0, 1), torch.cat(k_all))
    assert torch.equal(flat_v[:, slots].transpose(0, 1), torch.cat(v_all))

    num_heads = num_kv_heads * group
    q = torch.randn(B + 2, num_heads, head_dim).to(dtype)  # two rows that are not decodes: untouched
    token_rows = torch.tensor([r for r in range(B + 2) if r not in (1, 4)])
    out = torch.full_like(q, 7.0)
    positions = torch.tensor(contexts) - 1
    scale = head_dim**-0.5
    cpu.paged_decode_attention(out, q, k_cache, v_cache, token_rows, block_table, positions, window, scale)
    assert (out[[1, 4]] == 7).all()
    for b, n in enumerate(contexts):
        first = max(0, n - window) if window else 0
        k = k_all[b][first:].float().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v_all[b][first:].float().repeat_interleave(group, dim=1)
        qb = q[token_rows[b]].float()
        probs = (torch.einsum("hd,chd->hc", qb, k) * scale).softmax(-1)
        want = torch.einsum("hc,chd->hd", probs, v)
        torch.testing.assert_close(out[token_rows[b]].float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [5, 24, 100, 576])
def test_rms_norm_and_residual_add(dtype, hidden):
    from tokenmill.layers.norm import RMSNorm

    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x = torch.randn(33, hidden).to(dtype)
    residual = torch.randn(33, hidden).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cpu.rms_norm(x, norm.weight, norm.eps), norm._torch_forward(x), **tol)
    want_residual = residual + x
    out = cpu.add_rms_norm(residual, x, norm.weight, norm.eps)
    assert torch.equal(residual, want_residual)  # in place, rounded as torch's add
    torch.testing.assert_close(out, norm._torch_forward(want_residual), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [3, 8, 37, 1536])
def test_silu_and_mul(dtype, inter):
    torch.manual_seed(inter)
    x = (torch.randn(9, 2 * inter) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cpu.silu_and_mul(x), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [6, 16, 24, 32, 40, 64, 128])
def test_rotary_bit_equal(dtype, head_dim):
    from tokenmill.layers.rotary import rotate_half

    torch.manual_seed(head_dim)
    tokens, heads, kv_heads = 5, 3, 1
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = torch.randn(tokens, head_dim).to(dtype), torch.randn(tokens, head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    cpu.rotary(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [8, 9, 17, 24, 49152, 49157])
def test_argmax_logsumexp(dtype, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(8, vocab) * 5
    top = logits.max() + 1
    logits[0, [vocab - 1, vocab // 2]] = top  # a tie: the first index wins, whichever lane holds it
    if vocab > 16:
        logits[1, [3, 11, 16]] = top  # ties in different lanes of the first vectors
    logits[2, -1] = top + 1  # the maximum in the last element (a tail, where there is one)
    logits[3, 0] = top + 1  # the maximum in the first
    logits[4] = float("-inf")
    logits[5, 1:] = float("-inf")
    logits = logits.to(dtype).float()
    ids, lse = cpu.argmax_logsumexp(logits.to(dtype))
    assert torch.equal(ids, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))
    assert math.isinf(lse[4].item()) and lse[4].item() < 0


def tree_attention_case(dtype, head_dim, group, window, seed=0):
    """Requests whose last token is a token tree's root, then the tree's nodes in the next slots (random
    parents, up to 64 nodes: every bit of the mask), each node a query row at its depth's position that
    sees its context and its ancestors only; plus plain decode rows. Returns the kernel's inputs and a
    plain PyTorch masked-attention reference of every query row."""
    from tokenmill.spec_decode.tree import tree_layout

    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, block = 2, 16
    # (context before the tree, nodes): trees across block edges, a 64-node one, and plain decodes (0 nodes).
    cases = [(1, 3), (15, 6), (40, 64), (9, 0), (70, 13)]
    tables, kv, rows = [], [], []  # rows: (request, position, tree_start, mask)
    next_block = 1
    for b, (ctx, nodes) in enumerate(cases):
        total = ctx + nodes
        tables.append(list(range(next_block, next_block + -(-total // block))))
        next_block += len(tables[-1])
        kv.append((torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype),
                   torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)))
        rows.append((b, ctx - 1, ctx, 0))  # the root: a plain row
        if nodes:
            parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, nodes)])
            depth, mask = tree_layout(parents.numpy(), np.zeros(nodes, dtype=np.int64))
            rows += [(b, ctx - 1 + int(d), ctx, int(m)) for d, m in zip(depth, mask)]
    k_cache = torch.zeros(num_kv_heads, next_block, block, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([tables[b][p // block] * block + p % block for b in range(len(cases)) for p in range(len(kv[b][0]))])
    cpu.write_kv(k_cache, v_cache, torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), slots)
    max_blocks = max(map(len, tables))
    q = torch.randn(len(rows), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    want = []
    for r, (b, pos, start, mask) in enumerate(rows):
        first = max(0, pos + 1 - window) if window else 0
        seen = list(range(first, min(pos + 1, start) if mask else pos + 1))
        seen += [start + j for j in range(64) if (mask >> j) & 1]
        k = kv[b][0][seen].float().repeat_interleave(group, dim=1)
        v = kv[b][1][seen].float().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,chd->hc", q[r].float(), k) * scale).softmax(-1)
        want.append(torch.einsum("hc,chd->hd", probs, v))
    inputs = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, token_rows=torch.arange(len(rows)),
        block_table=torch.tensor([tables[b] + [0] * (max_blocks - len(tables[b])) for b, *_ in rows]),
        positions=torch.tensor([pos for _, pos, _, _ in rows]), tree_start=torch.tensor([s for _, _, s, _ in rows]),
        tree_mask=torch.tensor([m for *_, m in rows], dtype=torch.int64), scale=scale,
    )
    return inputs, torch.stack(want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (24, 3), (4, 2)], ids=["D64-G3", "D128-G2", "D24-G3", "D4-G2"])
@pytest.mark.parametrize("window", [None, 30])
def test_paged_decode_attention_with_token_trees(dtype, head_dim, group, window):
    """Tree attention (a node sees its context and its ancestors) against plain masked attention, on the
    fixed-size, generic vector and scalar paths."""
    i, want = tree_attention_case(dtype, head_dim, group, window)
    out = torch.zeros_like(i["q"])
    cpu.paged_decode_attention(out, i["q"], i["k_cache"], i["v_cache"], i["token_rows"], i["block_table"], i["positions"],
                               window, i["scale"], tree_start=i["tree_start"], tree_mask=i["tree_mask"])
    torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (24, 3)], ids=["D64-G3", "D128-G2", "D24-G3"])
@pytest.mark.parametrize("window", [None, 30])
def test_tree_rows_are_bit_equal_to_their_chains(dtype, head_dim, group, window):
    """A tree node's row is the plain decode row of the chain through its ancestors, bit for bit: the same
    K/V at consecutive positions after the same context (so a kept path is what decoding without
    speculation computes, in every dtype, on the fixed-size, generic and scalar paths)."""
    i, _ = tree_attention_case(dtype, head_dim, group, window)
    out = torch.zeros_like(i["q"])
    cpu.paged_decode_attention(out, i["q"], i["k_cache"], i["v_cache"], i["token_rows"], i["block_table"], i["positions"],
                               window, i["scale"], tree_start=i["tree_start"], tree_mask=i["tree_mask"])
    block = i["k_cache"].shape[2]
    checked = 0
    for r in range(len(i["token_rows"])):
        mask, start, pos = int(i["tree_mask"][r]), int(i["tree_start"][r]), int(i["positions"][r])
        if not mask:
            continue
        table = i["block_table"][r]
        chain = list(range(start)) + [start + j for j in range(64) if (mask >> j) & 1]
        slots = torch.tensor([int(table[p // block]) * block + p % block for p in chain])
        k = i["k_cache"].flatten(1, 2)[:, slots]  # [Hkv, len, D]: the chain's K at consecutive positions
        v = i["v_cache"].flatten(1, 2)[:, slots]
        blocks = -(-len(chain) // block)
        k_chain = torch.zeros(k.shape[0], blocks * block, head_dim, dtype=dtype)
        v_chain = torch.zeros_like(k_chain)
        k_chain[:, : len(chain)], v_chain[:, : len(chain)] = k, v
        got = torch.zeros_like(i["q"][r : r + 1])
        cpu.paged_decode_attention(got, i["q"][r : r + 1].contiguous(), k_chain.view(k.shape[0], blocks, block, head_dim),
                                   v_chain.view(k.shape[0], blocks, block, head_dim), torch.tensor([0]),
                                   torch.arange(blocks)[None], torch.tensor([pos]), window, i["scale"])
        assert torch.equal(got[0], out[r]), f"tree row {r} (depth {bin(mask).count('1')}) differs from its chain"
        checked += 1
    assert checked > 60
