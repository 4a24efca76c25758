"""Prompt-chunk attention: the tiled paged kernel (cpu/prefill_attention.cpp) against gather + SDPA.

    python benchmarks/chunk_attention.py [--dtypes float32,bfloat16] [--cases 1024:256,2048:512,4096:512,512:512]
                                         [--threads N] [--rounds 5] [--json out.json]

One attention layer's prompt-chunk group, as the engine runs it: a chunk of `chunk` query tokens
whose context ends at `ctx` (so it starts at ctx - chunk: after a prefix-cache hit or earlier
chunks; ctx == chunk is a whole prompt from position 0), SmolLM2-135M's heads (9 query heads, 3 KV
heads of 64), block size 16, blocks in random order. "gather+sdpa" is the reference backend's path
(TorchPagedAttention: the context's blocks gathered into a reused workspace, then SDPA with an
explicit causal mask, or with is_causal for chunks from position 0); "kernel" is the CPU backend's
(CpuPagedAttention). Each round times both, alternating; the table shows each one's median over
all its calls, in milliseconds (wall clock, or with --clock cpu the process's CPU time), and the ratio. The CPU's vector flags are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.kernels import cpu  # noqa: E402
from tokenmill.layers.attention import CpuPagedAttention, GatherWorkspace, TorchPagedAttention  # noqa: E402
from tokenmill.layers.attention_metadata import AttentionGroup  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in VECTOR_FLAGS if f in flags]
    return []


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_case(ctx: int, chunk: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-ctx // BLOCK)
    k_cache = torch.randn(KV_HEADS, num_blocks + 1, BLOCK, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(KV_HEADS, num_blocks + 1, BLOCK, HEAD_DIM, generator=g).to(dtype)
    table = (torch.randperm(num_blocks, generator=g) + 1)[None]
    q = torch.randn(chunk, HEADS, HEAD_DIM, generator=g).to(dtype)
    start = ctx - chunk
    group = AttentionGroup(torch.arange(chunk)[None], table, (start + torch.arange(chunk))[None], from_start=start == 0)
    return q, k_cache, v_cache, SimpleNamespace(attn_groups=[group])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cases", default="1024:256,2048:256,2048:512,4096:512,512:512,2048:2048", help="ctx:chunk,...")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="calls of each path per round")
    parser.add_argument("--rows-per-task", type=int, default=0, help="the kernel's query rows per task (0: its default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time per call (steadier on a shared machine; with --threads 1 it is the call's own time)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.cpu_kernels_available():
        sys.exit("tokenmill's CPU kernels did not build here; nothing to compare")
    os.environ.pop("TOKENMILL_PROMPT_KERNEL", None)
    print(f"CPU: {cpu_model()}; vector flags: {' '.join(cpu_flags())}; kernels: {cpu.vector_isa()}; torch threads: {torch.get_num_threads()}")
    print(f"heads {HEADS} q / {KV_HEADS} kv x {HEAD_DIM}, block {BLOCK}; medians in ms ({args.clock} clock) over {args.rounds} rounds x {args.reps} calls")
    print(f"{'dtype':9} {'ctx':>5} {'chunk':>5} {'start':>5} {'gather+sdpa':>12} {'kernel':>9} {'speedup':>8} {'max err':>8}")
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for case in args.cases.split(","):
            ctx, chunk = map(int, case.split(":"))
            q, k_cache, v_cache, batch = make_case(ctx, chunk, dtype)
            workspace = GatherWorkspace()

            def reference():
                return TorchPagedAttention.forward(q, k_cache, v_cache, batch, HEAD_DIM**-0.5, None, workspace)

            def kernel():
                if args.rows_per_task:
                    first_rows, starts, lens = batch.attn_groups[0].prompt_rows_starts_lens(chunk)
                    out = q.new_empty(chunk + 1, HEADS, HEAD_DIM)
                    cpu.paged_prefill_attention(out, q, k_cache, v_cache, first_rows, starts, lens, batch.attn_groups[0].block_table,
                                                None, HEAD_DIM**-0.5, args.rows_per_task)
                    return out[:chunk]
                return CpuPagedAttention.forward(q, k_cache, v_cache, batch, HEAD_DIM**-0.5, None, workspace)

            err = (reference().float() - kernel().float()).abs().max().item()
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            times = {"ref": [], "kernel": []}
            for _ in range(args.rounds):
                for name, fn in (("ref", reference), ("kernel", kernel)):
                    for _ in range(args.reps):
                        t0 = clock()
                        fn()
                        times[name].append((clock() - t0) * 1e3)
            ref_ms, ker_ms = statistics.median(times["ref"]), statistics.median(times["kernel"])
            row = dict(dtype=dtype_name, ctx=ctx, chunk=chunk, start=ctx - chunk, ref_ms=ref_ms, kernel_ms=ker_ms,
                       speedup=ref_ms / ker_ms, max_err=err)
            rows.append(row)
            print(f"{dtype_name:9} {ctx:5d} {chunk:5d} {ctx - chunk:5d} {ref_ms:12.2f} {ker_ms:9.2f} {ref_ms / ker_ms:7.2f}x {err:8.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), flags=cpu_flags(), isa=cpu.vector_isa(),
                                                   threads=torch.get_num_threads(), clock=args.clock, rows=rows), indent=1))


if __name__ == "__main__":
    main()
