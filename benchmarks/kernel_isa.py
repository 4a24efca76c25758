"""tokenmill's CPU kernels per instruction set: the scalar, AVX2 and AVX-512 builds against plain PyTorch.

    python benchmarks/kernel_isa.py [--levels x86-64,x86-64-v3,x86-64-v4] [--dtypes float32,bfloat16]
                                    [--batches 1,32] [--threads N] [--rounds 3] [--json out.json]

Each build (TOKENMILL_CPU_MARCH=<level>: x86-64 = the scalar loops, x86-64-v3 = AVX2+FMA+F16C,
x86-64-v4 = AVX-512; cpu/vec.h) runs in a process of its own, as do the plain PyTorch ops the
kernels replace (the engine's fallback paths). Shapes are SmolLM2-135M's (hidden 576, intermediate
1536, 9 query / 3 KV heads of 64, vocab 49152) for one decode step at batch 1 and 32; attention
at contexts 256 and 1024 (block size 16). Levels this CPU cannot run are left out. Every case is
timed call by call; the table shows each case's median in microseconds, the lowest median over
--rounds runs of every process (rounds alternate between the builds, so a busy machine disturbs
them alike). --threads sets torch's (and the kernels') threads; on a shared machine, 1 thread
gives steadier numbers (a parallel op waits for its slowest thread, and a thread the OS parks
costs a whole time slice). A build takes about a minute the first time; builds live in the usual
TORCH_EXTENSIONS_DIR, one directory per target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

LEVELS = {"x86-64": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "avx512"}
NEEDS = {  # /proc/cpuinfo flags a level's code may use
    "x86-64": set(),
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sse4_2", "popcnt"},
    "x86-64-v4": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK = 576, 1536, 9, 3, 64, 49152, 16
CONTEXTS = (256, 1024)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def time_us(fn, min_reps: int = 20, budget_s: float = 0.25) -> float:
    """Median wall time of one call, in microseconds."""
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 2000):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def cases(dtype_name: str, batch: int, backend: str):
    """(case name, thunk) for every kernel at this dtype and batch; backend "torch" gives the PyTorch ops."""
    import torch
    import torch.nn.functional as F

    from tokenmill.engine.messages import ScheduledChunk
    from tokenmill.kernels import cpu
    from tokenmill.layers.attention import GatherWorkspace, TorchPagedAttention
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import rotate_half
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.batch import build_batch_inputs

    dtype = getattr(torch, dtype_name)
    use_torch = backend == "torch"
    g = torch.Generator().manual_seed(batch)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    norm = RMSNorm(HIDDEN, eps=1e-5)
    norm.weight.data = randn(HIDDEN)
    x, residual = randn(batch, HIDDEN), randn(batch, HIDDEN)
    if use_torch:
        yield "rms_norm", lambda: norm._torch_forward(x)
        yield "add_rms_norm", lambda: norm._torch_forward(residual + x)
    else:
        yield "rms_norm", lambda: cpu.rms_norm(x, norm.weight, 1e-5)
        yield "add_rms_norm", lambda: cpu.add_rms_norm(residual, x, norm.weight, 1e-5)

    gate_up = randn(batch, 2 * INTER) * 4
    if use_torch:
        yield "silu_and_mul", lambda: (lambda gu: F.silu(gu[0]) * gu[1])(gate_up.chunk(2, dim=-1))
    else:
        yield "silu_and_mul", lambda: cpu.silu_and_mul(gate_up)

    qkv = randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(batch, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(batch, KV_HEADS, HEAD_DIM)
    angle = torch.rand(batch, HEAD_DIM // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    if use_torch:
        c, s = cos[:, None], sin[:, None]
        yield "rotary", lambda: (q * c + rotate_half(q) * s, k * c + rotate_half(k) * s)
    else:
        yield "rotary", lambda: cpu.rotary(q, k, cos, sin)  # in place, norm-preserving

    logits = randn(batch, VOCAB) * 5
    if use_torch:
        yield "argmax_logsumexp", lambda: (lambda lf: (lf.argmax(-1), torch.logsumexp(lf, -1)))(logits.float())
    else:
        yield "argmax_logsumexp", lambda: cpu.argmax_logsumexp(logits)

    workspace = GatherWorkspace()
    for ctx in CONTEXTS:
        blocks_per_req = ctx // BLOCK
        num_blocks = batch * blocks_per_req + 1
        k_cache, v_cache = randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM), randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, as after a while of serving
        chunks = [
            ScheduledChunk(f"r{b}", [0], ctx - 1, free[b * blocks_per_req : (b + 1) * blocks_per_req], True, SamplingParams(), 0, 0)
            for b in range(batch)
        ]
        inputs = build_batch_inputs(chunks, BLOCK, torch.device("cpu"))
        group = inputs.attn_groups[0]
        qd, new_k, new_v = randn(batch, HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM)
        out = torch.empty(batch + 1, HEADS, HEAD_DIM, dtype=dtype)
        if ctx == CONTEXTS[-1]:
            if use_torch:
                yield "write_kv", lambda: TorchPagedAttention.write_kv(k_cache, v_cache, new_k, new_v, inputs)
            else:
                yield "write_kv", lambda: cpu.write_kv(k_cache, v_cache, new_k, new_v, inputs.slot_mapping)
        if use_torch:
            yield f"attention ctx {ctx}", lambda: TorchPagedAttention.decode(qd, k_cache, v_cache, group, out, HEAD_DIM**-0.5, None, workspace)
        else:
            rows, pos = group.decode_rows_and_positions()
            yield f"attention ctx {ctx}", lambda: cpu.paged_decode_attention(out, qd, k_cache, v_cache, rows, group.block_table, pos, None, HEAD_DIM**-0.5)


def worker(backend: str, dtypes: list[str], batches: list[int], threads: int | None) -> None:
    import torch

    from tokenmill.kernels import cpu

    if threads:
        torch.set_num_threads(threads)

    if backend != "torch":
        result = cpu.load_cpu_kernels()
        if not result.available:
            raise SystemExit(f"the {backend} build failed: {result.error}")
        if cpu.vector_isa() != LEVELS[backend]:
            raise SystemExit(f"the {backend} build runs {cpu.vector_isa()} code, not {LEVELS[backend]}")
    results = {}
    for dtype in dtypes:
        for batch in batches:
            for name, fn in cases(dtype, batch, backend):
                results[f"{name}|{dtype}|{batch}"] = time_us(fn)
    print(json.dumps(dict(threads=torch.get_num_threads(), results=results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the medians here too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtypes, batches = args.dtypes.split(","), [int(b) for b in args.batches.split(",")]
    if args.worker:
        worker(args.worker, dtypes, batches, args.threads)
        return

    flags = cpu_flags()
    levels = [level for level in args.levels.split(",") if NEEDS[level] <= flags]
    skipped = [level for level in args.levels.split(",") if level not in levels]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    shown = sorted(flags & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})
    print(f"# {model}, {os.cpu_count()} CPUs; flags: {' '.join(shown)}")
    if skipped:
        print(f"# left out (this CPU cannot run them): {', '.join(skipped)}")
    backends = ["torch", *levels]
    best: dict[str, dict[str, float]] = {b: {} for b in backends}
    threads = None
    for _ in range(args.rounds):
        for backend in backends:
            env = dict(os.environ)
            env.pop("TOKENMILL_CPU_KERNELS", None)
            if backend != "torch":
                env["TOKENMILL_CPU_MARCH"] = backend
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", backend, "--dtypes", args.dtypes, "--batches", args.batches,
                 *(["--threads", str(args.threads)] if args.threads else [])],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{backend}: {proc.stderr.strip()[-2000:]}")
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            threads = report["threads"]
            for case, us in report["results"].items():
                best[backend][case] = min(us, best[backend].get(case, float("inf")))
    print(f"# torch threads: {threads}; median us per call (lowest of {args.rounds} rounds); speedup = torch / build")
    names = {"torch": "torch", **LEVELS}
    header = ["kernel", "dtype", "batch", *(names[b] for b in backends), *(f"x {names[b]}" for b in levels)]
    rows = []
    for case in best["torch"]:
        name, dtype, batch = case.split("|")
        times = [best[b][case] for b in backends]
        rows.append([name, dtype, batch, *(f"{t:.1f}" for t in times), *(f"{times[0] / t:.1f}" for t in times[1:])])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=model, flags=shown, threads=threads, medians_us=best), indent=1))


if __name__ == "__main__":
    main()
