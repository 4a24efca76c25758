"""tokenmill against llama.cpp and vLLM CPU on the same model, served, alternating round-robin.

    python benchmarks/quant_served.py [--model llama1b] [--rounds 3] [--servers tm-none,ll-none,tm-int8,ll-Q8_0,...]
    python benchmarks/quant_served.py --model tiny100m --servers tm-none,vllm-none --workload B --rounds 3

benchmarks/peers.py's `quant` step runs each server in turn, minutes apart; on a shared machine
whose memory bandwidth drifts by a third within an hour, that compares the moments more than the
engines. This starts every server first (one at a time, each waiting for /health; idle servers use
no CPU), then runs `tokenmill bench serve` against them round-robin, round after round, on the same
requests within a round, after a warm-up round that is not counted (--warmup-rounds; every server's
first traffic compiles kernels for new shapes and touches memory for the first time). It reads what
peers.py builds under WORK (default ~/.cache/tokenmill-peers):
the model folder and its GGUFs (`python benchmarks/peers.py --steps model,llamacpp-build,quant
--models M --quant-model M` makes them), llama-server, and vLLM's virtual environment (the
vllm-install step).

--workload: `single` (the default: 4 requests of 128 prompt / 128 output tokens, one at a time)
prints each server's median p50 time per output token; any other of peers.py's workloads (A, B, C,
C-nocache, rate4) runs as peers.py's served steps run it and prints each server's median output
throughput, and for every server after the first the median of its per-round ratios to the first
(the paired rounds are what resolves a 1.3x on a VM whose speed drifts by more than that between runs).

Servers: tm-none, tm-int8, tm-int4 (groups of 128), tm-int4g32, tm-gguf-Q8_0 / Q4_0 / Q4_1
(tokenmill -q gguf on llama-quantize's files), ll-none (the float GGUF), ll-Q8_0, ll-Q4_0, ll-Q4_1,
vllm-none (vLLM CPU on the model folder, started as peers.py starts it); `NAME@VAR=value+VAR2=value`
is server NAME with those environment variables set. The throughput workloads
give tokenmill and vLLM their default KV caches as peers.py does (one request at a time: 512 MB
for tokenmill), llama.cpp one slot per request up to 64.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from peers import (MAX_MODEL_LEN, SERVED_NAME, VLLM_KV_GIB, WORKLOADS, Ctx, llamacpp_server_command, llamacpp_slots, print_paired,
                   tokenmill_server_command, vllm_cpu_env, vllm_server_command)

from tokenmill.kernels import cpu as cpu_kernels

SINGLE = "single"
WARMUP_SEED = 1000  # warm-up round -1 uses seed 999: apart from the counted rounds' 0, 1, ...


def server_commands(ctx: Ctx, model: str, workload: str) -> dict[str, Callable[[int], list]]:
    """Each server's command for a port; paths (the model folders and GGUFs, llama-server, vLLM's python) as peers.py keeps them."""
    dtype = ctx.args.dtype
    folder = ctx.model_dir(model)
    throughput = workload != SINGLE
    no_cache = workload == "C-nocache"

    def tokenmill(port: int, path: Path, *options: str) -> list:
        memory = [] if throughput else ["--kv-cache-memory", str(512 << 20)]
        return tokenmill_server_command(sys.executable, path, dtype, port, "--served-model-name", SERVED_NAME, *memory,
                                        *(["--no-prefix-caching"] if no_cache else []), *options)

    def llama(port: int, gguf: Path) -> list:
        slots, per_slot = llamacpp_slots(workload) if throughput else (1, MAX_MODEL_LEN)
        return llamacpp_server_command(ctx.llama_server(), gguf, port, ctx.ncpu, slots, slots * per_slot,
                                       *(["--cont-batching"] if throughput else []))

    def vllm(port: int) -> list:
        return vllm_server_command(ctx.vllm_python, folder, dtype, port,
                                   "--no-enable-prefix-caching" if no_cache else "--enable-prefix-caching")

    gguf = lambda qtype: ctx.models_dir / f"{model}-{qtype}.gguf"  # noqa: E731
    return {
        "tm-none": lambda p: tokenmill(p, folder),
        "tm-int8": lambda p: tokenmill(p, folder, "-q", "int8"),
        "tm-int4": lambda p: tokenmill(p, folder, "-q", "int4"),
        "tm-int4g32": lambda p: tokenmill(p, folder, "-q", "int4", "--quantization-options", '{"group_size": 32}'),
        **{f"tm-gguf-{q}": (lambda p, q=q: tokenmill(p, gguf(q), "-q", "gguf")) for q in ("Q8_0", "Q4_0", "Q4_1")},
        "ll-none": lambda p: llama(p, ctx.gguf(model)),
        **{f"ll-{q}": (lambda p, q=q: llama(p, gguf(q))) for q in ("Q8_0", "Q4_0", "Q4_1")},
        "vllm-none": vllm,
    }


def split_server(name: str) -> tuple[str, dict[str, str]]:
    """A server's kind and the environment it adds: `tm-none@VAR=value+VAR2=value` is tm-none with those
    variables set (e.g. two tokenmill servers that differ only in an environment variable)."""
    kind, _, assignments = name.partition("@")
    extra = dict(pair.split("=", 1) for pair in assignments.split("+") if "=" in pair)
    return kind, extra


def server_env(ctx: Ctx, name: str) -> dict[str, str]:
    """The server's environment: its @ assignments, and vLLM's CPU settings as peers.py's vllm_env sets
    them (all cores: by default it keeps one back)."""
    kind, extra = split_server(name)
    vllm = vllm_cpu_env(ctx.ncpu, VLLM_KV_GIB) if kind.startswith("vllm") else {}
    return {**os.environ, **vllm, **extra}


def bench_arguments(workload: str, seed: int, server: str) -> list[str]:
    """`tokenmill bench serve`'s arguments for a round: the same requests for every server of the round (llama.cpp
    told per request not to reuse its cache for C-nocache, as peers.py does; the others start with it off)."""
    if workload == SINGLE:
        return ["--dataset", "random", "--num-prompts", "4", "--input-len", "128", "--output-len", "128", "--max-concurrency", "1",
                "--seed", str(seed)]
    llama = split_server(server)[0].startswith("ll-")
    extra = ["--extra-body", json.dumps({"cache_prompt": False})] if workload == "C-nocache" and llama else []
    return [*WORKLOADS[workload], "--seed", str(seed), *extra]


def wait_healthy(port: int, proc: subprocess.Popen, name: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was ready")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{name} was not ready after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="~/.cache/tokenmill-peers")
    parser.add_argument("--model", default="llama1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default="tm-none,ll-none,tm-int8,ll-Q8_0,tm-gguf-Q8_0,tm-int4g32,tm-gguf-Q4_0,ll-Q4_0,tm-int4,"
                                             "tm-gguf-Q4_1,ll-Q4_1")
    parser.add_argument("--workload", default=SINGLE, choices=[SINGLE, *(w for w in WORKLOADS if w != SINGLE)],
                        help="one request at a time (TPOT), or one of peers.py's workloads (output throughput)")
    parser.add_argument("--first-port", type=int, default=8200)
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds run first and not counted (their own requests): every server's first traffic "
                             "compiles kernels for new shapes and touches its memory for the first time")
    args = parser.parse_args()
    ctx = Ctx(argparse.Namespace(work_dir=args.work_dir, dtype=args.dtype))
    commands = server_commands(ctx, args.model, args.workload)
    names = [n.strip() for n in args.servers.split(",")]
    unknown = [n for n in names if split_server(n)[0] not in commands]
    if unknown:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(commands)}")
    flags = cpu_kernels.vector_flags()
    print(f"CPU flags: {flags}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="quant-served-"))
    procs: dict[str, tuple[int, subprocess.Popen]] = {}
    single = args.workload == SINGLE
    key, unit = ("median_tpot_ms", "ms") if single else ("output_throughput", "output tok/s")
    try:
        for i, name in enumerate(names):
            port = args.first_port + i
            command = commands[split_server(name)[0]](port)
            proc = subprocess.Popen([str(c) for c in command], stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                    env=server_env(ctx, name))
            procs[name] = (port, proc)
            wait_healthy(port, proc, name, timeout=900 if name.startswith("vllm") else 300)  # vLLM compiles for a minute or more
            print(f"{name} ready on port {port} (log {logs / (name + '.log')})", flush=True)
        values: dict[str, list[float]] = {n: [] for n in names}
        for r in range(-args.warmup_rounds, args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # the order flips each round: no server always runs first
                out = logs / f"{name}-{r}.json"
                seed = r if r >= 0 else WARMUP_SEED + r  # warm-up rounds: requests that no counted round repeats
                subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--base-url",
                                f"http://127.0.0.1:{procs[name][0]}", "--tokenizer", str(ctx.model_dir(args.model)),
                                *bench_arguments(args.workload, seed, name), "--model", SERVED_NAME, "--json", str(out)],
                               check=True, capture_output=True)
                value = json.loads(out.read_text())[key]
                if r >= 0:
                    values[name].append(value)
                print(f"{'round ' + str(r) if r >= 0 else 'warm-up'}: {name} {value:.2f} {unit}", flush=True)
        what = "one request at a time: median over {} rounds of p50 time per output token" if single else \
            f"workload {args.workload}: median over {{}} rounds of the output throughput"
        print(f"\n{args.model}, served, {what.format(args.rounds)}")
        print_paired(values, unit, higher_is_better=not single)
    finally:
        for _, proc in procs.values():
            proc.terminate()
        for _, proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
