"""Quantization on one model (weight-only, and w8a8): perplexity and single-request decode speed per method,
against the unquantized model in the same run (the README's quantization table).

    python benchmarks/quantization.py [--model PATH] [--dtype auto] [--rounds 3] [--methods "int8,int4 g32"] [--json out.json]

Each method runs `tokenmill bench perplexity` (the shipped text, windows of 512) and `tokenmill
bench latency --batch-size 1` in a process of its own; the latency rounds alternate between the
methods, so a busy machine disturbs them alike, and the table shows each method's median decode
time per token over the rounds. Prints the CPU's vector flags with the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = [
    ("none", None, None),
    ("int8", "int8", None),
    ("int4 g32", "int4", {"group_size": 32}),
    ("int4 g64", "int4", {"group_size": 64}),
    ("int4 g128", "int4", {"group_size": 128}),
    ("int4 g32 sym", "int4", {"group_size": 32, "symmetric": True}),
    ("w8a8", "w8a8", None),
    ("gguf", "gguf", None),  # the GGUF's own blocks, computed packed (the default model: Q4_1, Q8_0 embedding)
]
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def _bench(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", *args, "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def _method_args(common: list[str], method: str | None, options: dict | None) -> list[str]:
    args = list(common)
    if method:
        args += ["--quantization", method]
    if options:
        args += ["--quantization-options", json.dumps(options)]
    return args


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in FLAGS if f in have)
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(label for label, _, _ in METHODS),
                        help="comma-separated labels of the table's rows (default: all)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    wanted = args.methods.split(",")
    methods = [m for m in METHODS if m[0] in wanted or m[0] == "none"]
    common = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    rows = {label: {"decode_ms": []} for label, _, _ in methods}
    for label, method, options in methods:
        result = _bench(["perplexity", *_method_args(common, method, options)])
        rows[label].update(perplexity=result["perplexity"], dtype=result["dtype"])
    latency = ["latency", "--batch-size", "1", "--input-len", "32", "--output-len", "64", "--num-iters", "3",
               "--num-iters-warmup", "1", "--disable-tqdm"]
    for _ in range(args.rounds):
        for label, method, options in methods:
            result = _bench([*latency, *_method_args(common, method, options)])
            rows[label]["decode_ms"].append(result["tokenmill"]["decode_time_per_token_ms"])
    base = rows["none"]
    base_ms = statistics.median(base["decode_ms"])
    print(f"CPU flags: {cpu_flags()}; dtype {base['dtype']}")
    print("| method | perplexity | vs unquantized | decode ms/token (batch 1) | speed-up |")
    print("|---|---|---|---|---|")
    for label, row in rows.items():
        ms = statistics.median(row["decode_ms"])
        delta = 100 * (row["perplexity"] / base["perplexity"] - 1)
        print(f"| {label} | {row['perplexity']:.3f} | {delta:+.2f}% | {ms:.2f} | {base_ms / ms:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_flags": cpu_flags(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
