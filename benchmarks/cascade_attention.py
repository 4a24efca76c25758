"""Cascade attention for decodes over a shared prefix: on against off, one layer and workload C end to end.

    python benchmarks/cascade_attention.py [--dtypes float32,bfloat16] [--parts layer,engine] [--rounds 3]
                                           [--threads N] [--model PATH] [--json out.json]

layer:  one attention layer's decode group as workload C's decode steps run it: 64 requests whose contexts
        start with the same 1,024 tokens (the same 64 physical blocks), each with 32 + 16 tokens of its own,
        SmolLM2-135M's heads (9 query heads, 3 KV heads of 64), block size 16. "plain" is the decode kernel
        over each whole context (the prefix read once per request), "cascade" the prefix pass once for all
        requests plus each request's rest, merged. Medians in ms over alternating rounds (wall clock, or
        with --clock cpu the process's CPU time: steadier on a shared machine, where a parallel region
        can wait a whole scheduler slice for its second thread).
engine: workload C (benchmarks/peers.py: 64 requests sharing a 1,024-token prefix, 32-token suffixes,
        32 output tokens, greedy, EOS ignored) through `tokenmill bench throughput`'s loop, on two engines
        in this process, cascade_attention=True and False, alternating rounds after a warm-up round each.
        Medians over the rounds of output tok/s, TPOT (time per output token after the first) and the
        process's CPU time per output token (the steadier figure on a shared machine; with --threads 1
        it is the run's own work).

The CPU's vector flags are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.chunk_attention import cpu_flags, cpu_model  # noqa: E402
from tokenmill.kernels import cpu  # noqa: E402
from tokenmill.layers.attention import CpuPagedAttention  # noqa: E402
from tokenmill.layers.attention_metadata import AttentionGroup  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
NUM_REQUESTS, PREFIX, OWN = 64, 1024, 48


def layer_case(dtype: torch.dtype, seed: int = 0):
    """Workload C's decode group halfway through its outputs, with and without its shared prefix marked."""
    g = torch.Generator().manual_seed(seed)
    shared, own = PREFIX // BLOCK, -(-OWN // BLOCK)
    num_blocks = 1 + shared + NUM_REQUESTS * own
    k_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    prefix_blocks = perm[:shared]
    table = torch.cat([prefix_blocks.expand(NUM_REQUESTS, shared), perm[shared:].view(NUM_REQUESTS, own)], dim=1)
    q = torch.randn(NUM_REQUESTS, HEADS, HEAD_DIM, generator=g).to(dtype)
    rows = torch.arange(NUM_REQUESTS)[:, None]
    pos = torch.full((NUM_REQUESTS, 1), PREFIX + OWN - 1)
    plain = AttentionGroup(rows, table, pos)
    cascade = AttentionGroup(rows, table, pos, shared_prefix=(PREFIX, prefix_blocks))
    return q, k_cache, v_cache, plain, cascade


def run_layer(dtypes: list[str], rounds: int, reps: int, clock) -> list[dict]:
    print(f"layer: {NUM_REQUESTS} decodes, {PREFIX}-token shared prefix + {OWN} own; heads {HEADS} q / {KV_HEADS} kv x {HEAD_DIM}; "
          f"medians in ms over {rounds} rounds x {reps} calls")
    print(f"{'dtype':9} {'plain':>8} {'cascade':>8} {'speedup':>8} {'max err':>8}")
    out = []
    for name in dtypes:
        dtype = getattr(torch, name)
        q, kc, vc, plain, cascade = layer_case(dtype)
        buf = q.new_empty(NUM_REQUESTS + 1, HEADS, HEAD_DIM)

        def call(group: AttentionGroup) -> torch.Tensor:
            CpuPagedAttention.decode(q, kc, vc, group, buf, HEAD_DIM**-0.5, None, None)
            return buf[:NUM_REQUESTS].clone()

        err = (call(plain).float() - call(cascade).float()).abs().max().item()
        times: dict[str, list[float]] = {"plain": [], "cascade": []}
        for _ in range(rounds):
            for key, group in (("plain", plain), ("cascade", cascade)):
                for _ in range(reps):
                    t0 = clock()
                    CpuPagedAttention.decode(q, kc, vc, group, buf, HEAD_DIM**-0.5, None, None)
                    times[key].append((clock() - t0) * 1e3)
        p, c = statistics.median(times["plain"]), statistics.median(times["cascade"])
        print(f"{name:9} {p:8.2f} {c:8.2f} {p / c:7.2f}x {err:8.1e}", flush=True)
        out.append(dict(dtype=name, plain_ms=p, cascade_ms=c, speedup=p / c, max_err=err))
    return out


def run_engine(dtypes: list[str], rounds: int, model: str | None) -> list[dict]:
    from tokenmill.bench.datasets import prefix_dataset
    from tokenmill.bench.throughput import run_throughput, warm_up
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine

    print(f"engine: workload C ({NUM_REQUESTS} requests, {PREFIX}-token shared prefix, 32-token suffixes, 32 output tokens), "
          f"medians over {rounds} rounds after a warm-up round")
    print(f"{'dtype':9} {'cascade':>8} {'out tok/s':>10} {'TPOT ms':>8} {'CPU ms/tok':>10}")
    out = []
    for name in dtypes:
        engines = {
            on: LLMEngine(EngineConfig.from_kwargs(model=model, dtype=name, max_model_len=2048, num_kv_blocks=1024, cascade_attention=on))
            for on in (True, False)
        }
        first = engines[True]
        requests = prefix_dataset(NUM_REQUESTS, first.vocab_size, PREFIX, 32, 32, seed=0, exclude=first.eos_token_ids)
        results: dict[bool, list[dict]] = {True: [], False: []}
        for on, engine in engines.items():
            warm_up(engine, requests[0].prompt_token_ids[:16])
            run_throughput(engine, requests, use_tqdm=False)  # warm-up round: the prefix is cached from here on, for both
        for _ in range(rounds):
            for on, engine in engines.items():
                t0 = time.process_time()
                r = run_throughput(engine, requests, use_tqdm=False)
                r["cpu_ms_per_output_token"] = (time.process_time() - t0) * 1e3 / r["total_output_tokens"]
                results[on].append(r)
        row = dict(dtype=name)
        for on in (True, False):
            tok_s = statistics.median(r["output_tokens_per_second"] for r in results[on])
            tpot = statistics.median(r["median_tpot_ms"] for r in results[on])
            cpu_ms = statistics.median(r["cpu_ms_per_output_token"] for r in results[on])
            row["on" if on else "off"] = dict(output_tokens_per_second=tok_s, tpot_ms=tpot, cpu_ms_per_output_token=cpu_ms)
            print(f"{name:9} {'on' if on else 'off':>8} {tok_s:10.1f} {tpot:8.2f} {cpu_ms:10.2f}", flush=True)
        row["tpot_speedup"] = row["off"]["tpot_ms"] / row["on"]["tpot_ms"]
        row["cpu_speedup"] = row["off"]["cpu_ms_per_output_token"] / row["on"]["cpu_ms_per_output_token"]
        print(f"{name:9} off / on: TPOT {row['tpot_speedup']:.2f}x, CPU per token {row['cpu_speedup']:.2f}x", flush=True)
        out.append(row)
        del engines, first
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--parts", default="layer,engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="layer: calls of each path per round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="layer: wall clock or the process's CPU time")
    parser.add_argument("--model", default=None, help="engine: the model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.cpu_kernels_available():
        sys.exit("tokenmill's CPU kernels did not build here; cascade attention runs in them")
    print(f"CPU: {cpu_model()}; vector flags: {' '.join(cpu_flags())}; kernels: {cpu.vector_isa()}; torch threads: {torch.get_num_threads()}")
    dtypes, parts = args.dtypes.split(","), args.parts.split(",")
    result = dict(cpu=cpu_model(), flags=cpu_flags(), isa=cpu.vector_isa(), threads=torch.get_num_threads())
    if "layer" in parts:
        result["layer"] = run_layer(dtypes, args.rounds, args.reps, time.process_time if args.clock == "cpu" else time.perf_counter)
    if "engine" in parts:
        result["engine"] = run_engine(dtypes, args.rounds, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
