"""tokenmill's quantized methods against llama.cpp on the same model, served, one request at a time, alternating.

    python benchmarks/quant_served.py [--model llama1b] [--rounds 3] [--servers tm-none,ll-none,tm-int8,ll-Q8_0,...]

benchmarks/peers.py's `quant` step runs each server in turn, minutes apart; on a shared machine
whose memory bandwidth drifts by a third within an hour, that compares the moments more than the
engines. This starts every server first (one at a time, each waiting for /health; idle servers use
no CPU), then runs `tokenmill bench serve` (4 requests of 128 prompt / 128 output tokens, one at a
time) against them round-robin, round after round, and prints each server's median p50 time per
output token. It reads what peers.py builds under WORK (default ~/.cache/tokenmill-peers): the
model folder and its GGUFs (`python benchmarks/peers.py --steps model,llamacpp-build,quant
--models M --quant-model M` makes them) and llama-server.

Servers: tm-none, tm-int8, tm-int4 (groups of 128), tm-int4g32, tm-gguf-Q8_0 / Q4_0 / Q4_1
(tokenmill -q gguf on llama-quantize's files), ll-none (the float GGUF), ll-Q8_0, ll-Q4_0, ll-Q4_1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tokenmill.kernels import cpu as cpu_kernels


def server_commands(work: Path, model: str, dtype: str) -> dict[str, Callable[[int], list]]:
    models = work / "models"
    folder = models / model

    def tokenmill(port: int, path: Path, *options: str) -> list:
        return [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", path, "--dtype", dtype, "--max-model-len", "2048",
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "peer", "--kv-cache-memory", str(512 << 20), *options]

    def llama(port: int, gguf: Path) -> list:
        threads = str(os.cpu_count() or 1)  # as peers.py runs it
        return [work / "llama-build" / "bin" / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", "peer",
                "-t", threads, "-tb", threads, "-np", "1", "-c", "2048"]

    gguf = lambda qtype: models / f"{model}-{qtype}.gguf"  # noqa: E731
    return {
        "tm-none": lambda p: tokenmill(p, folder),
        "tm-int8": lambda p: tokenmill(p, folder, "-q", "int8"),
        "tm-int4": lambda p: tokenmill(p, folder, "-q", "int4"),
        "tm-int4g32": lambda p: tokenmill(p, folder, "-q", "int4", "--quantization-options", '{"group_size": 32}'),
        **{f"tm-gguf-{q}": (lambda p, q=q: tokenmill(p, gguf(q), "-q", "gguf")) for q in ("Q8_0", "Q4_0", "Q4_1")},
        "ll-none": lambda p: llama(p, gguf(dtype)),
        **{f"ll-{q}": (lambda p, q=q: llama(p, gguf(q))) for q in ("Q8_0", "Q4_0", "Q4_1")},
    }


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
    parser.add_argument("--first-port", type=int, default=8200)
    args = parser.parse_args()
    work = Path(args.work_dir).expanduser()
    commands = server_commands(work, args.model, args.dtype)
    names = [n.strip() for n in args.servers.split(",")]
    unknown = [n for n in names if n not in commands]
    if unknown:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(commands)}")
    flags = cpu_kernels.vector_flags()
    print(f"CPU flags: {flags}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="quant-served-"))
    procs: dict[str, tuple[int, subprocess.Popen]] = {}
    try:
        for i, name in enumerate(names):
            port = args.first_port + i
            proc = subprocess.Popen([str(c) for c in commands[name](port)], stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)
            procs[name] = (port, proc)
            wait_healthy(port, proc, name)
            print(f"{name} ready on port {port} (log {logs / (name + '.log')})", flush=True)
        tpot: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:
                out = logs / f"{name}-{r}.json"
                subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--base-url",
                                f"http://127.0.0.1:{procs[name][0]}", "--tokenizer", str(work / "models" / args.model), "--dataset", "random",
                                "--num-prompts", "4", "--input-len", "128", "--output-len", "128", "--max-concurrency", "1", "--seed", str(r),
                                "--model", "peer", "--json", str(out)], check=True, capture_output=True)
                tpot[name].append(json.loads(out.read_text())["median_tpot_ms"])
                print(f"round {r}: {name} {tpot[name][-1]:.2f} ms", flush=True)
        print(f"\n{args.model}, served, one request at a time: median over {args.rounds} rounds of p50 time per output token")
        for name in names:
            print(f"{name:>14}: {statistics.median(tpot[name]):7.2f} ms  ({', '.join(f'{t:.2f}' for t in tpot[name])})")
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
