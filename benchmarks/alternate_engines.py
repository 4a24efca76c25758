"""Workload A on several engine settings in one process, rounds alternating: output tok/s per round,
medians, and each setting's ratio to the first one per round (the figure that holds on a noisy machine).

    python benchmarks/alternate_engines.py none=none w8a8=w8a8 head='w8a8:{"quantize_lm_head": true}' \
        [--model PATH] [--rounds 5] [--kv-cache-memory 1e9] [--num-prompts 32]

Each setting is LABEL=METHOD[:JSON quantization options][@NAME=VALUE,...] (METHOD `none` for
unquantized; after @, environment variables set while that engine is built, e.g.
`4k=none@TOKENMILL_HUGE_PAGE_WEIGHTS=0`). Every run gets prompts no other run had (no prefix-cache
hits across runs); the KV caches are faulted in first (worker/cpu_memory.py), and the order of the
settings flips every round. --num-prompts 1: one request at a time's speed (also as ms per token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

from tokenmill import LLM, SamplingParams

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 128, 128  # workload A of benchmarks/peers.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="LABEL=METHOD[:JSON options]")
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-memory", type=float, default=1e9)
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    args = parser.parse_args()
    num_prompts = args.num_prompts

    engines = {}
    for setting in args.settings:
        label, _, spec = setting.partition("=")
        spec, _, env = spec.partition("@")
        method, _, options = spec.partition(":")
        with mock.patch.dict(os.environ, dict(pair.split("=", 1) for pair in env.split(",") if pair)):
            engines[label] = LLM(model=args.model, quantization=None if method == "none" else method,
                                 quantization_options=json.loads(options) if options else None, kv_cache_memory=int(args.kv_cache_memory))
    for llm in engines.values():
        llm.llm_engine.executor.driver_runner.finish_weight_move()
        llm.llm_engine.executor.driver_runner.kv_prefault.wait()
    vocab = next(iter(engines.values())).llm_engine.vocab_size
    labels = list(engines)
    prompts = [[(i * 7 + j * 13) % (vocab - 200) + 100 for j in range(INPUT_LEN)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    results: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for i, label in enumerate(labels if r % 2 == 0 else labels[::-1]):
            shift = len(labels) * r + i + 1  # prompts of their own
            start = time.perf_counter()
            engines[label].generate(prompt_token_ids=[[t + shift for t in p] for p in prompts], sampling_params=params, use_tqdm=False)
            results[label].append(num_prompts * OUTPUT_LEN / (time.perf_counter() - start))
    for label, values in results.items():
        per_token = f" ({1000 / statistics.median(values):.2f} ms a token)" if num_prompts == 1 else ""
        print(f"{label}: output tok/s per round {[round(v, 1) for v in values]}, median {statistics.median(values):.1f}{per_token}")
    for label in labels[1:]:
        ratios = [a / b for a, b in zip(results[label], results[labels[0]])]
        print(f"{label} / {labels[0]}: per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
