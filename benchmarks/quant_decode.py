"""Single-request decode time of each quantization method on one model, alternating in one process.

    python benchmarks/quant_decode.py [--model PATH] [--methods "none,int8,int4 g32,int4,gguf"] [--rounds 5] [--tokens 32]

Loads one LLM per method (the default model: the embedded SmolLM2-135M; `gguf` needs a GGUF file;
"int4 g32" is int4 with groups of 32, "gguf float" gguf with float activations) and times, round by round and method after method, the
generation of 1 and of tokens + 1 tokens after a 32-token prompt (greedy, EOS ignored): the
difference over `tokens` is the decode time per token, without the prompt. Prints the CPU flags
and each method's median, its ratio to the first method's and the median of the rounds' ratios,
since these machines are shared and noisy and only same-process alternating ratios mean anything. `python benchmarks/peers.py --steps
model --models llama1b` builds the 1B Llama this was measured on besides SmolLM2.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels


def method_kwargs(method: str) -> dict:
    """ "none", "int8", "int4", "int4 g32", "gguf", "gguf float" (float activations), "w8a8" -> LLM keyword arguments."""
    name, *extra = method.split()
    kwargs: dict = {"quantization": None if name == "none" else name}
    options = {}
    for word in extra:
        if word == "float":
            options["activations"] = "float"
        elif word.startswith("g") and word[1:].isdigit():
            options["group_size"] = int(word[1:])
        else:
            raise SystemExit(f"unknown method word {word!r} in {method!r}: g<group size> or float")
    if options:
        kwargs["quantization_options"] = options
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--methods", default="none,int8,int4 g32,int4")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    flags = cpu_kernels.vector_flags()
    print(f"CPU flags: {flags}", flush=True)
    methods = [m.strip() for m in args.methods.split(",")]
    llms = {m: LLM(model=args.model, dtype=args.dtype, max_num_seqs=4, **method_kwargs(m)) for m in methods}
    prompts = [{"prompt_token_ids": list(range(100, 132))}]

    def seconds(llm: LLM, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for llm in llms.values():
        seconds(llm, 4)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for method, llm in llms.items():
            times[method].append((seconds(llm, args.tokens + 1) - seconds(llm, 1)) / args.tokens * 1e3)
    base = statistics.median(times[methods[0]])
    for method in methods:
        median = statistics.median(times[method])
        # The memory's speed drifts within minutes here: each round's ratio compares times taken
        # seconds apart, so their median is steadier than the ratio of the two medians.
        per_round = statistics.median(b / t for b, t in zip(times[methods[0]], times[method]))
        print(f"{method:>10}: {median:6.2f} ms per token ({base / median:.2f}x {methods[0]}, median of the rounds' "
              f"ratios {per_round:.2f}x); rounds: {', '.join(f'{t:.2f}' for t in times[method])}", flush=True)


if __name__ == "__main__":
    main()
