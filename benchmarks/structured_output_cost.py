"""The per-step cost of structured output against unconstrained sampling, in the same run.

Same engine, same prompts, same batch size and max_tokens: every request decodes exactly
max_tokens tokens (unconstrained: ignore_eos; constrained: a JSON schema that cannot close within
max_tokens, so the grammar never ends the request early). The two kinds alternate for several
rounds so machine noise hits both alike. Per engine step (decode steps only: the prompt step is
left out) it reports the median wall time, and for the constrained steps the share spent in the
grammar (filling the bitmask before the forward pass, advancing the matchers after it).

    python benchmarks/structured_output_cost.py [--batch 8] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

SUBJECTS = ["a cat", "a teacher", "a pirate", "a robot", "a chef", "a child", "an astronaut", "a farmer",
            "a doctor", "a musician", "a king", "a spy", "a baker", "a sailor", "a poet", "a judge"]
# A list of at least 200 strings: cannot be closed within a few hundred tokens.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["facts"],
}


def run(llm: LLM, prompts: list[str], params: list[SamplingParams], timings: dict[str, list[float]]) -> None:
    engine = llm.llm_engine
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    manager = engine._structured
    grammar_time = [0.0]
    if manager is not None:  # time the grammar work by wrapping the manager's two entry points
        bitmask, accept = manager.bitmask, manager.accept

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    grammar_time[0] += time.perf_counter() - t0
            return wrapper

        manager.bitmask, manager.accept = timed(bitmask), timed(accept)
    first = True
    try:
        while engine.has_unfinished_requests():
            grammar_time[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if first:  # the prompt (prefill) step
                first = False
                continue
            timings["step"].append(elapsed)
            timings["grammar"].append(grammar_time[0])
    finally:
        if manager is not None:
            del manager.bitmask, manager.accept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory=128 << 20)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"List facts about {s} as JSON."}], tokenize=False, add_generation_prompt=True)
        for s in (SUBJECTS * ((args.batch + len(SUBJECTS) - 1) // len(SUBJECTS)))[: args.batch]
    ]
    kinds = {
        "unconstrained": lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True),
        "json schema": lambda i: SamplingParams(
            temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
            structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
        ),
    }
    # Warm-up: compile the grammar, touch the KV cache.
    for make in kinds.values():
        run(llm, prompts, [make(i) for i in range(args.batch)], {"step": [], "grammar": []})
    results = {name: {"step": [], "grammar": []} for name in kinds}
    for _ in range(args.rounds):
        for name, make in kinds.items():
            run(llm, prompts, [make(i) for i in range(args.batch)], results[name])

    base = statistics.median(results["unconstrained"]["step"])
    print(f"batch {args.batch}, {args.max_tokens} tokens each, {args.rounds} rounds; median decode-step wall time:")
    for name, r in results.items():
        step = statistics.median(r["step"])
        line = f"  {name:14s} {step * 1e3:8.2f} ms/step ({len(r['step'])} steps)"
        if name != "unconstrained":
            grammar = statistics.median(r["grammar"])
            line += (f"  = {step / base:.3f}x unconstrained ({(step - base) * 1e3:+.2f} ms); "
                     f"grammar work {grammar * 1e3:.2f} ms/step ({grammar / args.batch * 1e3:.3f} ms per request)")
        print(line)


if __name__ == "__main__":
    main()
