"""tokenmill against vLLM CPU (or HF) offline, in paired rounds: peers.py's offline steps alternated.

    python benchmarks/offline_paired.py --models tiny100m --workloads A,B,C --rounds 3

peers.py runs each engine once, one after the other; on a shared VM whose speed drifts by more than the
ratios it measures, one such run decides little. This runs peers.py's offline steps (`tokenmill`, `vllm`,
`hf`: the same commands, requests and result files) round after round, the engines' order flipping
every round, and prints per workload each engine's median output throughput and the median of the
per-round ratios of the first engine to each other one. It needs what peers.py builds (the model and
vllm-install steps); each engine's last round stays in peers.py's results directory for its table step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from peers import MODELS, SERVE_ONLY, WORKLOADS, Ctx, _figures, print_paired, resolve_dtype

OFFLINE_ENGINES = ("tokenmill", "vllm", "hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="~/.cache/tokenmill-peers")
    parser.add_argument("--models", default=MODELS[0], help="comma-separated (default tiny100m)")
    parser.add_argument("--workloads", default="A,B,C", help="comma-separated, from A, B, C, C-nocache")
    parser.add_argument("--engines", default="tokenmill,vllm", help=f"comma-separated, from {', '.join(OFFLINE_ENGINES)}; the first is the base")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    offline = [w for w in WORKLOADS if w not in SERVE_ONLY]
    bad = [e for e in engines if e not in OFFLINE_ENGINES] + [w for w in workloads if w not in offline]
    if bad:
        raise SystemExit(f"unknown engine(s) or offline workload(s): {', '.join(bad)}")
    dtype = resolve_dtype(args.dtype)
    ctx = Ctx(argparse.Namespace(work_dir=args.work_dir, dtype=dtype))
    print(f"{ctx.machine['cpu']}, flags {' '.join(ctx.machine['flags'])}, dtype {dtype}", flush=True)
    peers = Path(__file__).with_name("peers.py")
    for model in (m.strip() for m in args.models.split(",")):
        for workload in workloads:
            values: dict[str, list[float]] = {e: [] for e in engines}
            for r in range(args.rounds):
                for engine in engines if r % 2 == 0 else engines[::-1]:  # no engine always runs first
                    result = ctx.result(engine, model, workload)
                    result.unlink(missing_ok=True)
                    subprocess.run([sys.executable, peers, "--steps", engine, "--models", model, "--workloads", workload,
                                    "--dtype", dtype, "--work-dir", args.work_dir], check=True, capture_output=True)
                    if not result.exists():
                        raise SystemExit(f"{engine} wrote no result for {model} {workload} (see {ctx.logs})")
                    values[engine].append(_figures(engine, json.loads(result.read_text()))["output_tok_s"])
                    print(f"{model} {workload} round {r}: {engine} {values[engine][-1]:.1f} output tok/s", flush=True)
            print(f"\n{model}, offline, workload {workload}: median over {args.rounds} rounds of the output throughput")
            print_paired(values, "output tok/s", higher_is_better=True)


if __name__ == "__main__":
    main()
