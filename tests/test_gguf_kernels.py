"""The packed GGUF kernels (tokenmill/kernels/cpu/gguf_linear.cpp) against gguf's own numpy
dequantize + a float64 matmul, for every block type quantization="gguf" computes packed.
tests/test_kernel_isa.py runs this file again on the AVX2 (and, under -m slow, the AVX-512 and
scalar) builds.

The weights are random valid blocks: random bytes, with each fp16 scale field overwritten by a
finite random fp16 (every other bit pattern of these formats is a valid block).

Tolerances: the kernels' dequantize is gguf's value for value (asserted exactly); the linear sums
in float32 in another order than the reference, so float32 results agree within 1e-5 of the sum
of |x| * |w| (the size of the rounding a float32 dot product of those terms can carry); bf16 and
fp16 outputs are rounded once from those sums, so within one ulp of the dtype (2^-7 relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tokenmill.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

# Each packed type and the byte offsets of its fp16 scale fields within a block.
FP16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
TYPES = list(FP16_FIELDS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_packed(qtype: T, rows: int, cols: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """[rows, cols / QK * bytes] uint8 of random valid blocks of qtype (fp16 scales ~ N(0, scale))."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def _shapes(qtype: T) -> list[tuple[int, int]]:
    block = GGML_QUANT_SIZES[qtype][0]
    return [(1, block), (7, 2 * block), (64, 576 if block == 32 else 512), (33, 1536 if block == 32 else 1024)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_dequantize_is_gguf_value_for_value(qtype, dtype):
    for n, k in _shapes(qtype):
        packed = random_packed(qtype, n, k, seed=n + k)
        want = torch.from_numpy(dequantize(packed, qtype).reshape(n, k))
        got = cpu.gguf_dequantize(torch.from_numpy(packed), int(qtype), k, dtype)
        assert got.dtype == dtype and got.shape == (n, k)
        torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_linear_matches_dequantize_and_matmul(qtype, rows, dtype):
    for n, k in _shapes(qtype):
        gen = torch.Generator().manual_seed(n + k + rows)
        packed = random_packed(qtype, n, k, seed=n * k + rows)
        weight = torch.from_numpy(dequantize(packed, qtype).reshape(n, k)).double()
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        for b in (bias, None):
            want = x.double() @ weight.T + (b.double() if b is not None else 0)
            got = cpu.gguf_linear(x, torch.from_numpy(packed), int(qtype), k, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            if dtype == torch.float32:
                bound = 1e-5 * (x.double().abs() @ weight.abs().T + 1)
                assert ((got.double() - want).abs() <= bound).all(), f"{qtype.name} {n}x{k}: off by {(got.double() - want).abs().max()}"
            else:
                torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=1e-2, rtol=2**-7)


def test_gguf_kernels_refuse_bad_input():
    packed = torch.from_numpy(random_packed(T.Q4_1, 4, 64, seed=0))
    with pytest.raises(RuntimeError, match="GGML type 6 is not computed packed"):
        cpu.gguf_linear(torch.randn(1, 64), packed, 6, 64, None)  # Q5_0
    with pytest.raises(RuntimeError, match="bytes per row"):
        cpu.gguf_linear(torch.randn(1, 96), packed, int(T.Q4_1), 96, None)
    with pytest.raises(RuntimeError, match="not a multiple"):
        cpu.gguf_dequantize(packed, int(T.Q4_K), 64, torch.float32)
