"""The weight-only quantization formats and their CPU kernels against the plain PyTorch reference
(tokenmill/layers/quantization/quant_utils.py). tests/test_kernel_isa.py runs this file again on
the AVX2 (and, under -m slow, the AVX-512 and scalar) builds.

Tolerances: the kernels accumulate in float32 in another order than torch's GEMM, so float32
results agree to ~1e-5 relative; bf16/fp16 results are rounded once from float32 sums that differ
in the last bits, so they agree within one ulp of the dtype.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu
from tokenmill.layers.quantization import quant_utils as Q, weight_only as wo

pytestmark = pytest.mark.skipif(not cpu.cpu_kernels_available(), reason="tokenmill's CPU kernels are not built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [*ROWS, 33])  # 33: several passes of rows over each tile (run_tiles' next-tile prefetch)
@pytest.mark.parametrize("shape", [(96, 64), (43, 201), (3, 40), (576, 1536)], ids=str)  # 43 x 201: part tiles, an odd K
def test_dense_linear_matches_float_reference(shape, rows, dtype):
    """decode_linear.cpp's packed full-precision weights (a decode step's matmul) against F.linear in float32."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    w, x, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    packed = cpu.dense_pack(w)
    _close(cpu.dense_linear(x, packed, n, bias), torch.nn.functional.linear(x.float(), w.float(), bias.float()).to(dtype))
    _close(cpu.dense_linear(x, packed, n, None), torch.nn.functional.linear(x.float(), w.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(96, 64), (43, 200), (576, 1536)], ids=str)  # 43 x 200: a part tile, a K that is no multiple of the vector width
def test_int8_linear_matches_reference(shape, rows, dtype):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    q, scale = Q.quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = cpu.int8_pack(q)
    _close(cpu.int8_linear(x, packed, scale, n, bias), Q.int8_linear_reference(x, q, scale, bias))
    _close(cpu.int8_linear(x, packed, scale, n, None), Q.int8_linear_reference(x, q, scale, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True), (128, False)])
@pytest.mark.parametrize("shape", [(96, 64), (43, 576), (576, 1536)], ids=str)  # 43: a part tile; 576 = 4.5 groups of 128: a short last group
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=str)  # the scales and mins int4_pack keeps
def test_int4_linear_matches_reference(shape, scale_dtype, group_size, symmetric, rows, dtype):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows + group_size)
    packed, scale, minimum = Q.quantize_int4(torch.randn(n, k, generator=gen), group_size, symmetric)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = Q.int4_linear_reference(x, packed, scale, minimum, group_size, bias)
    tiles = cpu.int4_pack(packed, scale.to(scale_dtype), minimum.to(scale_dtype))
    assert tiles[1].dtype == tiles[2].dtype == scale_dtype
    _close(cpu.int4_linear(x, *tiles, group_size, n, bias), want)
    if symmetric:  # no mins stored: -8 x scale in the kernel
        tiles = cpu.int4_pack(packed, scale.to(scale_dtype), minimum.new_empty(0).to(scale_dtype))
        assert tiles[2].numel() == 0
        _close(cpu.int4_linear(x, *tiles, group_size, n, bias), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True), (128, False)])
@pytest.mark.parametrize("shape", [(96, 64), (43, 576), (576, 1536)], ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=str)
def test_int4_linear_a8_matches_reference(shape, scale_dtype, group_size, symmetric, rows, dtype):
    """int4 against x quantized to int8 per block of 32 (GGUF Q4_0 / Q4_1 as llama.cpp computes them)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows + group_size)
    packed, scale, minimum = Q.quantize_int4(torch.randn(n, k, generator=gen), group_size, symmetric)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0
    bias = torch.randn(n, generator=gen).to(dtype)
    want = Q.int4_linear_a8_reference(x, packed, scale, minimum, group_size, bias)
    stored_min = minimum.new_empty(0) if symmetric else minimum  # symmetric: no mins stored, -8 x scale in the kernel
    tiles = cpu.int4_pack(packed, scale.to(scale_dtype), stored_min.to(scale_dtype))
    # Two float32 sums (the int4 values against x's int8 blocks, the mins against x) whose terms cancel:
    # the reference's rounding differs by up to ~1e-3 on K = 1536, where the outputs run to ~50.
    close = lambda got, want: _close(got, want) if dtype != torch.float32 else torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # noqa: E731
    close(cpu.int4_linear_a8(x, *tiles, group_size, n, bias), want)
    close(cpu.int4_linear_a8(x, *tiles, group_size, n, None), Q.int4_linear_a8_reference(x, packed, scale, minimum, group_size, None))


def test_activations_int8_error_is_at_most_half_a_step():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 10
    step = x.view(5, 3, 32).abs().amax(dim=-1, keepdim=True) / 127
    assert ((Q.quantize_activations_int8(x) - x).view(5, 3, 32).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(Q.quantize_activations_int8(torch.zeros(1, 32)), torch.zeros(1, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(96, 64), (43, 576), (576, 1536)], ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=str)
def test_int8_group_linear_matches_reference(shape, scale_dtype, rows, dtype):
    """int8 with a scale per row and group of 32 inputs (GGUF's Q8_0, on the tiles) against dequantize + float32 matmul."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).to(scale_dtype)
    x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    weight = q.float() * scale.float().repeat_interleave(32, dim=1)
    tiles, scale_tiles, no_super = wo.int8_group_tiles(q, scale)
    _close(cpu.int8_group_linear(x, tiles, scale_tiles, no_super, 32, n, bias), Q._float32_linear(x, weight, bias))
    assert torch.equal(cpu.int8_group_dequantize(tiles, scale_tiles, no_super, 32, n, dtype), weight.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(40, 256), (96, 512)], ids=str)
def test_int8_group_linear_with_two_levels_of_scales(shape, rows, dtype):
    """GGUF Q6_K's scales: an int8 scale per row and 16 inputs times an fp16 one per 256, multiplied in float32 (exactly)."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + rows)
    q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    super_scale = (torch.rand(n, k // 256, generator=gen) * 1e-3).half()
    x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    group_scale = scale.float() * super_scale.float().repeat_interleave(16, dim=1)
    weight = q.float() * group_scale.repeat_interleave(16, dim=1)
    tiles, scale_tiles, super_tiles = wo.int8_group_tiles(q, scale, super_scale)
    _close(cpu.int8_group_linear(x, tiles, scale_tiles, super_tiles, 16, n, bias), Q._float32_linear(x, weight, bias))
    assert torch.equal(cpu.int8_group_dequantize(tiles, scale_tiles, super_tiles, 16, n, dtype), weight.to(dtype))
    with pytest.raises(RuntimeError, match="super_scale goes with int8 scales"):
        cpu.int8_group_linear(x, tiles, scale_tiles, None, 16, n, bias)
    with pytest.raises(RuntimeError, match="super_scale must be fp16"):
        cpu.int8_group_linear(x, tiles, scale_tiles, super_tiles.float(), 16, n, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_ops_match_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(83, 576, generator=gen)  # 83: a part tile
    q, scale = Q.quantize_int8(w)
    assert torch.equal(cpu.int8_dequantize(cpu.int8_pack(q), scale, 83, dtype), Q.dequantize_int8(q, scale).to(dtype))
    packed, s, m = Q.quantize_int4(w, 128, False)
    for scale_dtype in (torch.float32, torch.float16):  # quantize_int4's scales and mins are fp16 values: the same weights
        tiles = cpu.int4_pack(packed, s.to(scale_dtype), m.to(scale_dtype))
        assert torch.equal(cpu.int4_dequantize(*tiles, 128, 83, dtype), Q.dequantize_int4(packed, s, m, 128).to(dtype))
    packed, s, m = Q.quantize_int4(w, 128, True)  # symmetric: wo.int4_tiles stores no mins
    tiles = wo.int4_tiles(packed, s, m)
    assert tiles[1].dtype == torch.float16 and tiles[2].numel() == 0
    assert torch.equal(cpu.int4_dequantize(*tiles, 128, 83, dtype), Q.dequantize_int4(packed, s, m, 128).to(dtype))


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    packed = Q.pack_int4(q)
    assert packed.shape == (7, 48) and packed.dtype == torch.uint8
    assert torch.equal(Q.unpack_int4(packed), q)
    # The block layout the kernels read: byte j of a 32-weight block = weight j | weight j + 16 << 4.
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 16]) << 4


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_error_is_at_most_half_a_step(symmetric):
    w = torch.randn(64, 200 - 8, generator=torch.Generator().manual_seed(1))  # 192: a short last group of 64
    packed, scale, minimum = Q.quantize_int4(w, 128, symmetric)
    error = (Q.dequantize_int4(packed, scale, minimum, 128) - w).abs()
    step = scale.repeat_interleave(128, dim=1)[:, : w.shape[1]]
    # Symmetric groups clamp the positive end at 7 steps of amax / 7: still within half a step.
    assert bool((error <= step * 0.5 + 1e-6).all())


def test_int4_asymmetric_keeps_weights_already_on_a_4bit_grid():
    """A checkpoint already quantized to 4 bits per group of 32 (GGUF Q4_1: fp16 scales and mins) loses nothing more."""
    gen = torch.Generator().manual_seed(2)
    levels = torch.randint(0, 16, (32, 128), generator=gen).float()
    levels[:, ::32], levels[:, 1::32] = 0.0, 15.0  # every group uses the whole range
    scale, low = (torch.rand(32, 4, generator=gen) + 0.1).half().float(), torch.randn(32, 4, generator=gen).half().float()
    w = levels * scale.repeat_interleave(32, dim=1) + low.repeat_interleave(32, dim=1)
    packed, s, m = Q.quantize_int4(w, 32, symmetric=False)
    torch.testing.assert_close(Q.dequantize_int4(packed, s, m, 32), w, atol=1e-5, rtol=1e-5)


def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(4))
    q, scale = Q.quantize_int8(w)
    assert bool(((Q.dequantize_int8(q, scale) - w).abs() <= scale[:, None] * 0.5 + 1e-7).all())
    assert int(q.abs().max()) == 127


def test_bad_shapes_are_errors():
    packed = cpu.dense_pack(torch.randn(8, 64))
    for x, n in ((torch.randn(2, 64).bfloat16(), 8), (torch.randn(2, 32), 8), (torch.randn(2, 64), 40)):  # dtype, K, N
        with pytest.raises(RuntimeError, match="dense_linear: the weight must be dense_pack's layout"):
            cpu.dense_linear(x, packed, n, None)
    q, scale = Q.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="int8_linear: the weight must be int8_pack's layout"):
        cpu.int8_linear(torch.randn(2, 32), cpu.int8_pack(q), scale, 8, None)
    with pytest.raises(RuntimeError, match="int8_linear: the weight must be int8_pack's layout"):
        cpu.int8_linear(torch.randn(2, 64), q, scale, 8, None)  # not packed
    packed, s, m = Q.quantize_int4(torch.randn(8, 64), 32, False)
    tiles = cpu.int4_pack(packed, s, m)
    with pytest.raises(RuntimeError, match="int4_linear: scale and min must be int4_pack's"):
        cpu.int4_linear(torch.randn(2, 64), *tiles, 16, 8, None)  # 4 groups where 2 were packed
    with pytest.raises(RuntimeError, match="int4_linear: the weight must be int4_pack's layout"):
        cpu.int4_linear(torch.randn(2, 64), packed, s, m, 32, 8, None)  # not packed
    with pytest.raises(RuntimeError, match="int4_linear: x has 32 features, the weight 64"):
        cpu.int4_linear(torch.randn(2, 32), *tiles, 32, 8, None)
    with pytest.raises(RuntimeError, match=r"int4_linear_a8: in_features \(64\) and group size \(16\) must be multiples of 32"):
        cpu.int4_linear_a8(torch.randn(2, 64), *cpu.int4_pack(packed, s.repeat_interleave(2, dim=1), m.repeat_interleave(2, dim=1)), 16, 8, None)
    with pytest.raises(ValueError, match="divisible by 32"):
        Q.quantize_int4(torch.randn(8, 48), 32, False)
