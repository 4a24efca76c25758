"""The quantized KV cache's kernels against the unquantized cache, on SmolLM2-135M's attention shapes.

    python benchmarks/kv_quant.py [--dtype float32] [--batches 1,32] [--contexts 512,2048] [--rounds 5] [--threads N]

One decode step of one layer (9 query / 3 KV heads of 64, block size 16): the C++ decode kernel over
each request's paged context (`paged_decode_attention`), and the write of the step's new K/V
(`write_kv` / `write_kv_quantized`), for kv_cache_dtype auto, int8, fp8 (e4m3) and fp8_e5m2. Every
case is timed call by call (median); rounds alternate between the cache dtypes, so a busy machine
disturbs them alike, and the table shows the median over rounds with the ratio to auto. Prints the
CPU's vector flags and the kernels' ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tokenmill.kernels import cpu
from tokenmill.layers.kv_quant import KVScales, kv_storage_dtype

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
KV_DTYPES = ("auto", "int8", "fp8", "fp8_e5m2")


def time_us(fn, min_reps: int = 10, budget_s: float = 0.3) -> float:
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def cases(dtype: torch.dtype, batch: int, ctx: int, kv: str):
    g = torch.Generator().manual_seed(batch * 7 + ctx)
    blocks_per = -(-ctx // BLOCK)
    num_blocks = batch * blocks_per + 1
    cache_dtype = kv_storage_dtype(kv, dtype)
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    scales = KVScales.allocate(cache_dtype, shape, torch.device("cpu"))
    table = (torch.randperm(num_blocks - 1, generator=g)[: batch * blocks_per] + 1).view(batch, blocks_per)
    # Fill every context through the write op, as prompt chunks do.
    slots = (table[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)[:, :ctx].flatten()
    k_all = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_all = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g).to(dtype)

    def write(k, v, s):
        if scales is None:
            cpu.write_kv(k_cache, v_cache, k, v, s)
        else:
            cpu.write_kv_quantized(k_cache, v_cache, scales.k, scales.v, k, v, s)

    write(k_all, v_all, slots)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)
    rows = torch.arange(batch)
    positions = torch.full((batch,), ctx - 1)
    ks, vs = (None, None) if scales is None else (scales.k, scales.v)
    last = slots.view(batch, ctx)[:, -1].contiguous()  # one new token per request: a decode step's write
    k_new, v_new = k_all[:batch].clone(), v_all[:batch].clone()
    yield "attention", lambda: cpu.paged_decode_attention(out, q, k_cache, v_cache, rows, table, positions, None, HEAD_DIM**-0.5, ks, vs)
    yield "write (1 token/request)", lambda: write(k_new, v_new, last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert cpu.cpu_kernels_available(), "the CPU kernels did not build"
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    print(f"CPU flags: {' '.join(f for f in wanted if f in flags)}; kernels: {cpu.vector_isa()}; threads: {torch.get_num_threads()}")
    dtype = getattr(torch, args.dtype)
    results: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                for kv in KV_DTYPES:
                    for name, fn in cases(dtype, batch, ctx, kv):
                        results.setdefault((name, batch, ctx, kv), []).append(time_us(fn))
    print(f"\n{args.dtype} model; median us over {args.rounds} alternating rounds (ratio: auto's time / this one's)")
    print(f"{'case':<26}{'batch':>6}{'ctx':>6}" + "".join(f"{kv:>18}" for kv in KV_DTYPES))
    for name, batch, ctx in dict.fromkeys((n, b, c) for n, b, c, _ in results):
        base = statistics.median(results[(name, batch, ctx, "auto")])
        cells = []
        for kv in KV_DTYPES:
            t = statistics.median(results[(name, batch, ctx, kv)])
            cells.append(f"{t:9.1f} ({base / t:4.2f}x)")
        print(f"{name:<26}{batch:>6}{ctx:>6}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
