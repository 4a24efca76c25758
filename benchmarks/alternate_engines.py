"""Workload A on several engine settings in one process, rounds alternating: output tok/s per round,
medians, and each setting's ratio to the first one per round (the figure that holds on a noisy machine).

    python benchmarks/alternate_engines.py none=none w8a8=w8a8 head='w8a8:{"quantize_lm_head": true}' \
        [--model PATH] [--rounds 5] [--kv-cache-memory 1e9] [--num-prompts 32] [--input-len 128] [--output-len 128]

Each setting is LABEL=METHOD[:JSON quantization options][@NAME=VALUE,...][+JSON engine arguments]
(METHOD `none` for unquantized; after @, environment variables set while that engine is built, e.g.
`4k=none@TOKENMILL_HUGE_PAGE_WEIGHTS=0`; after +, more arguments of `LLM`, e.g.
`kv8=none+{"kv_cache_dtype": "int8"}`). Every run gets prompts no other run had (no prefix-cache
hits across runs); the KV caches are faulted in first (worker/cpu_memory.py), and the order of the
settings flips every round. --num-prompts 1: one request at a time's speed (also as ms per token).

--dataset chat: the bench's held-out chat prompts instead of the random token ids, greedy until EOS or
--output-len (an output's real length counts), the next --num-prompts of them each round (for
speculative decoding, whose speed depends on what is written: e.g. `none=none
'eagle=none+{"speculative_config": {"method": "eagle", "model": "eagle/", "num_speculative_tokens": 2,
"tree_width": 3}}' --dataset chat --num-prompts 1 --rounds 8 --lockstep`).

--lockstep: each round gives every engine the same requests at once and steps the engines in turn,
one engine step each (LLMEngine.step(), the order flipping every step), so all of them run under the
same load from the machine's neighbours: on a shared VM whose speed drifts by tens of percent
within a minute, whole-run rounds can disagree by 2x while lockstep rounds agree within a few
percent. A round's figure is each engine's output tokens over the sum of its own steps' times;
it also prints the median over decode steps (every prompt computed) of each step's time ratio.
The engines take turns on the same cores, so an engine's weights are out of the caches when its
step begins (at workload A's 32 rows they stream from memory anyway; a one-request run, whose
weights might otherwise stay in L3, reads slower this way).
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
    parser.add_argument("--input-len", type=int, default=INPUT_LEN)
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--lockstep", action="store_true", help="interleave the engines step by step (see above)")
    parser.add_argument("--dataset", choices=("random", "chat"), default="random", help="the prompts (see above)")
    args = parser.parse_args()
    num_prompts = args.num_prompts

    engines = {}
    for setting in args.settings:
        label, _, spec = setting.partition("=")
        spec, plus, engine_args = spec.partition("+{")
        spec, _, env = spec.partition("@")
        method, _, options = spec.partition(":")
        with mock.patch.dict(os.environ, dict(pair.split("=", 1) for pair in env.split(",") if pair)):
            engines[label] = LLM(model=args.model, quantization=None if method == "none" else method,
                                 quantization_options=json.loads(options) if options else None, kv_cache_memory=int(args.kv_cache_memory),
                                 **(json.loads("{" + engine_args) if plus else {}))
    for llm in engines.values():
        llm.llm_engine.executor.driver_runner.finish_weight_move()
        llm.llm_engine.executor.driver_runner.kv_prefault.wait()
    vocab = next(iter(engines.values())).llm_engine.vocab_size
    labels = list(engines)
    if args.dataset == "chat":
        from tokenmill.bench.datasets import chat_dataset

        chats = [r.prompt_token_ids for r in chat_dataset(next(iter(engines.values())).get_tokenizer(), num_prompts * args.rounds,
                                                          args.output_len)]

        def round_prompts(r: int, i: int) -> list[list[int]]:
            """Round r's prompts (the i-th engine's run of it: the same for every engine)."""
            return chats[r * num_prompts : (r + 1) * num_prompts]
    else:
        base = [[(i * 7 + j * 13) % (vocab - 200) + 100 for j in range(args.input_len)] for i in range(num_prompts)]

        def round_prompts(r: int, i: int) -> list[list[int]]:
            """Round r's prompts for its i-th run, shifted so that no other run had them (no prefix-cache hits
            across runs); lockstep gives every engine of a round i = 0."""
            return [[t + r * len(labels) + i + 1 for t in p] for p in base]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=args.dataset == "random")
    for llm in engines.values():  # warm-up
        llm.generate(prompt_token_ids=round_prompts(0, 0)[:2], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)

    results: dict[str, list[float]] = {label: [] for label in labels}
    run = run_lockstep if args.lockstep else run_alternating
    run(engines, round_prompts, params, args.rounds, results)
    for label, values in results.items():
        per_token = f" ({1000 / statistics.median(values):.2f} ms a token)" if num_prompts == 1 else ""
        print(f"{label}: output tok/s per round {[round(v, 1) for v in values]}, median {statistics.median(values):.1f}{per_token}")
    for label in labels[1:]:
        ratios = [a / b for a, b in zip(results[label], results[labels[0]])]
        print(f"{label} / {labels[0]}: per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")


def output_tokens(outputs) -> int:
    """The tokens generated in these finished RequestOutputs."""
    return sum(len(c.token_ids) for out in outputs if out.finished for c in out.outputs)


def run_alternating(engines: dict[str, LLM], round_prompts, params: SamplingParams, rounds: int,
                    results: dict[str, list[float]]) -> None:
    """Rounds of whole runs, one engine after the other, the order flipping every round."""
    labels = list(engines)
    for r in range(rounds):
        for i, label in enumerate(labels if r % 2 == 0 else labels[::-1]):
            start = time.perf_counter()
            outputs = engines[label].generate(prompt_token_ids=round_prompts(r, i), sampling_params=params, use_tqdm=False)
            results[label].append(output_tokens(outputs) / (time.perf_counter() - start))


def run_lockstep(engines: dict[str, LLM], round_prompts, params: SamplingParams, rounds: int,
                 results: dict[str, list[float]]) -> None:
    """Rounds of the engines stepping in turn on the same requests (see the module's --lockstep)."""
    labels = list(engines)
    decode_ratios: dict[str, list[float]] = {label: [] for label in labels[1:]}
    for r in range(rounds):
        prompts = round_prompts(r, 0)
        for label, llm in engines.items():
            for i, prompt in enumerate(prompts):
                llm.llm_engine.add_request({"prompt_token_ids": prompt}, params, f"lockstep-{r}-{i}")
        busy = {label: 0.0 for label in labels}
        tokens = {label: 0 for label in labels}
        step = 0
        while any(llm.llm_engine.has_unfinished_requests() for llm in engines.values()):
            decode_times = {}  # this turn's step time of each engine whose step was decode only
            for label in labels if step % 2 == 0 else labels[::-1]:
                engine = engines[label].llm_engine
                if not engine.has_unfinished_requests():
                    continue
                decoding = all(req.num_computed_tokens >= req.num_prompt_tokens for req in engine.scheduler.requests.values())
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                busy[label] += elapsed
                tokens[label] += output_tokens(outputs)
                if decoding:
                    decode_times[label] = elapsed
            for label in labels[1:]:
                if labels[0] in decode_times and label in decode_times:
                    decode_ratios[label].append(decode_times[labels[0]] / decode_times[label])
            step += 1
        for label in labels:
            results[label].append(tokens[label] / busy[label])
    for label, ratios in decode_ratios.items():
        if ratios:
            print(f"{label} / {labels[0]}: decode steps' time ratio {labels[0]}/{label}, median of {len(ratios)} steps "
                  f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
