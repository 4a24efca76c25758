"""Speculative decoding on one model: time per output token of single requests with each proposer,
against decoding without speculation in the same run (the README's speculative decoding table).

    python benchmarks/spec_decode.py [--model PATH] [--dtype auto] [--device cpu] [--rounds 3] [--dataset edit] [--num-prompts 4]
                                     [--configs "none,ngram k4,self int4 k3"] [--medusa HEADS] [--eagle HEAD]
                                     [--batch-size 1 | --one-process] [--json out.json]

Each configuration runs `tokenmill bench throughput --num-prompts 1` once per prompt (one request at a
time: the single-request latency speculation is for) in a process of its own, greedy, stopping at EOS;
rounds alternate between the configurations, so a busy machine disturbs them alike. The table shows
each one's median time per output token (TPOT) over every request of every round, the speed-up over
no speculation, the acceptance rate and the mean accepted length. Prints the CPU's vector flags.
With --one-process, each configuration's prompts run in one process per round, one request at a time
(the engine's --max-num-seqs 1), the median over them its TPOT for the round: fewer process starts.
With --batch-size B, each run sends B prompts at once (the next B of the dataset), and the speed-up is
that of the median output throughput (tokens/s over the run) instead of the time per output token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quantization import _bench, cpu_flags  # noqa: E402

_CONFIDENT = {"min_draft_probability": 0.1, "stop_draft_probability": 0.5}
CONFIGS = {
    "none": None,
    "ngram k2": {"method": "ngram", "num_speculative_tokens": 2},
    "ngram k4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k6": {"method": "ngram", "num_speculative_tokens": 6},
    "self int4 k2": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 2},
    "self int4 k3": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 3},
    "self int8 k3": {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3},
    "self int8 k4": {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 4},
    "self int8 k6": {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 6},
    "self int4 k4": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 4},
    "self int4 k6": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 6},
    "self w8a8 k3": {"method": "draft_model", "model": "self", "quantization": "w8a8", "num_speculative_tokens": 3},
    # Medusa heads from --medusa (e.g. `tokenmill train-medusa --output heads/`).
    "medusa k1": {"method": "medusa", "num_speculative_tokens": 1},
    "medusa k2": {"method": "medusa", "num_speculative_tokens": 2},
    "medusa k3": {"method": "medusa", "num_speculative_tokens": 3},
    # Token trees: the top-1 chain of k with w - 1 more candidates of each head beside it (k * w nodes).
    "medusa k2 w2": {"method": "medusa", "num_speculative_tokens": 2, "tree_width": 2},
    "medusa k2 w4": {"method": "medusa", "num_speculative_tokens": 2, "tree_width": 4},
    "medusa k3 w2": {"method": "medusa", "num_speculative_tokens": 3, "tree_width": 2},
    "medusa k3 w3": {"method": "medusa", "num_speculative_tokens": 3, "tree_width": 3},
    "medusa k3 w4": {"method": "medusa", "num_speculative_tokens": 3, "tree_width": 4},
    # A sparse tree in the style of Medusa's medusa_choices: more candidates where the guesses are better.
    "medusa tree10": {"method": "medusa", "tree": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 2], [0, 0, 0], [0, 0, 1]]},
    # An EAGLE head from --eagle (e.g. `tokenmill train-eagle --output head/`).
    "eagle k1": {"method": "eagle", "num_speculative_tokens": 1},
    "eagle k2": {"method": "eagle", "num_speculative_tokens": 2},
    "eagle k3": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle k4": {"method": "eagle", "num_speculative_tokens": 4},
    # EAGLE trees: the top-1 chain with candidates beside it (the draft passes follow the chain only).
    "eagle k1 w2": {"method": "eagle", "num_speculative_tokens": 1, "tree_width": 2},
    "eagle k1 w3": {"method": "eagle", "num_speculative_tokens": 1, "tree_width": 3},
    "eagle k2 w2": {"method": "eagle", "num_speculative_tokens": 2, "tree_width": 2},
    "eagle k2 w3": {"method": "eagle", "num_speculative_tokens": 2, "tree_width": 3},
    "eagle k3 w2": {"method": "eagle", "num_speculative_tokens": 3, "tree_width": 2},
    "eagle tree5": {"method": "eagle", "tree": [[0], [1], [2], [0, 0], [0, 0, 0]]},
    "eagle k2 w4": {"method": "eagle", "num_speculative_tokens": 2, "tree_width": 4},
    # Wide first, then deeper along the top-1 chain: 4 + 2 + 1 nodes.
    "eagle tree7": {"method": "eagle", "tree": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 0, 0]]},
    # Confidence (min_draft_probability 0.1, stop_draft_probability 0.5): per request and step, only the
    # nodes the draft finds probable enough, and passes only while its top-1 chain is.
    "eagle k4 dyn": {"method": "eagle", "num_speculative_tokens": 4, **_CONFIDENT},
    "eagle k3 w3 dyn": {"method": "eagle", "num_speculative_tokens": 3, "tree_width": 3, **_CONFIDENT},
    "eagle k4 w4 dyn": {"method": "eagle", "num_speculative_tokens": 4, "tree_width": 4, **_CONFIDENT},
    # The head in int8 (its layers and draft-vocabulary rows).
    "eagle k1 w3 int8": {"method": "eagle", "num_speculative_tokens": 1, "tree_width": 3, "quantization": "int8"},
    "eagle k4 w4 dyn int8": {"method": "eagle", "num_speculative_tokens": 4, "tree_width": 4, **_CONFIDENT, "quantization": "int8"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: tokenmill's, the CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", default="edit", help="a `tokenmill bench throughput` dataset (default: edit)")
    parser.add_argument("--num-prompts", type=int, default=4, help="requests per round, run one at a time")
    parser.add_argument("--input-len", type=int, default=160)
    parser.add_argument("--configs", default="none,ngram k4,self int8 k3,self int4 k3")
    parser.add_argument("--medusa", default=None, help="the Medusa heads' folder, for the medusa configs")
    parser.add_argument("--eagle", default=None, help="the EAGLE head's folder, for the eagle configs")
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (default: the dataset's)")
    parser.add_argument("--batch-size", type=int, default=1, help="requests sent at once per run (default: 1)")
    parser.add_argument("--one-process", action="store_true",
                        help="each configuration's prompts of a round in one process, one request at a time (--max-num-seqs 1): "
                             "a process start per configuration and round, not per prompt (for a GPU, whose start costs more than its run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.one_process and args.batch_size != 1:
        parser.error("--one-process sends one request at a time: leave --batch-size at 1")
    if "none" not in names:
        names.insert(0, "none")
    if any(name.startswith("medusa") for name in names) and not args.medusa:
        parser.error("the medusa configs need --medusa HEADS_FOLDER")
    if any(name.startswith("eagle") for name in names) and not args.eagle:
        parser.error("the eagle configs need --eagle HEAD_FOLDER")
    per_run = args.num_prompts if args.one_process else args.batch_size
    common = ["throughput", "--dataset", args.dataset, "--num-prompts", str(per_run), "--input-len", str(args.input_len),
              "--no-ignore-eos", "--dtype", args.dtype, "--disable-tqdm"] + (["--model", args.model] if args.model else [])
    common += ["--max-num-seqs", "1"] if args.one_process else []
    common += ["--device", args.device] if args.device else []
    if args.output_len is not None:
        common += ["--output-len", str(args.output_len)]
    rows = {name: {"tpot_ms": [], "tokens_per_s": [], "drafts": 0, "draft_tokens": 0, "accepted": 0, "outputs": []} for name in names}
    for _ in range(args.rounds):
        for seed in [0] if args.one_process else range(args.num_prompts):
            for name in names:
                spec = CONFIGS[name]
                if spec is not None and spec["method"] in ("medusa", "eagle"):
                    spec = {**spec, "model": args.medusa if spec["method"] == "medusa" else args.eagle}
                extra = ["--seed", str(seed * args.batch_size)] + (["--speculative-config", json.dumps(spec)] if spec else [])
                result = _bench([*common, *extra])["tokenmill"]
                row = rows[name]
                row["tpot_ms"].append(result["median_tpot_ms"])
                row["tokens_per_s"].append(result["output_tokens_per_second"])
                row["outputs"].append(result["total_output_tokens"])
                # As it goes (stderr), so a run cut short by a time limit still leaves its numbers.
                which = f"prompts 0-{args.num_prompts - 1}" if args.one_process else f"prompt {seed}"
                print(f"{name}, {which}: TPOT {result['median_tpot_ms']:.2f} ms, {result['output_tokens_per_second']:.1f} tok/s",
                      file=sys.stderr, flush=True)
                spec_stats = result.get("spec_decode")
                if spec_stats:
                    row["drafts"] += spec_stats["num_drafts"]
                    row["draft_tokens"] += spec_stats["num_draft_tokens"]
                    row["accepted"] += spec_stats["num_accepted_tokens"]
    base = statistics.median(rows["none"]["tpot_ms"])
    base_rate = statistics.median(rows["none"]["tokens_per_s"])
    runs = f"{args.num_prompts} requests one at a time in a process" if args.one_process else f"{args.num_prompts} runs of {args.batch_size} request(s)"
    print(f"device {args.device or 'cpu'}; CPU flags: {cpu_flags()}; dtype {args.dtype}; dataset {args.dataset}, {runs} x {args.rounds} rounds")
    print("| speculative config | TPOT ms (median) | output tok/s (median) | speed-up | acceptance rate | mean accepted length |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        ms, rate_s = statistics.median(row["tpot_ms"]), statistics.median(row["tokens_per_s"])
        speedup = base / ms if args.batch_size == 1 else rate_s / base_rate
        rate = f"{100 * row['accepted'] / row['draft_tokens']:.0f}%" if row["draft_tokens"] else "-"
        length = f"{1 + row['accepted'] / row['drafts']:.2f}" if row["drafts"] else "-"
        print(f"| {name} | {ms:.1f} | {rate_s:.0f} | {speedup:.2f}x | {rate} | {length} |")
        if row["outputs"] != rows["none"]["outputs"]:
            print(f"  (output lengths differ from no speculation: {row['outputs']} vs {rows['none']['outputs']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_flags": cpu_flags(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
