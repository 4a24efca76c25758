"""The Llama family's decode programs against the layers' forward, whole model (models/llama.py).

    python benchmarks/decode_program.py [--model PATH] [--dtype auto] [-q METHOD] [--batches 1,4,32] [--rounds 7] [--tokens 128]

Loads the model (by default the embedded SmolLM2-135M) once and times greedy generation of --tokens
tokens for --batches requests at a time (32-token prompts; prefix caching off, so all compute them),
the decode steps taking the C++ decode program (where the model has one), the Python one, or every
layer's forward, the three alternating round by round in one process, since these machines are
shared and noisy. Prints the median milliseconds per step of each, the medians of the rounds'
ratios against forward, and checks all give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-q", "--quantization", default=None)
    parser.add_argument("--batches", default="1,4,32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    print(f"CPU flags: {cpu_kernels.vector_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(batches), enable_prefix_caching=False)
    model = llm.llm_engine.executor.worker.runner.model.model
    if not hasattr(model, "use_decode_program"):
        raise SystemExit(f"{type(model).__name__} has no decode program (the Llama family's models have one)")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    settings = {"forward": (False, False), "python program": (True, False), "C++ program": (True, True)}
    for batch in batches:
        prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in settings}
        tokens: dict[str, list] = {}
        for round_ in range(args.rounds):
            for name in settings if round_ % 2 == 0 else reversed(settings):
                model.use_decode_program, model.use_native_decode = settings[name]
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append((time.perf_counter() - start) / args.tokens * 1e3)
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
        model.use_decode_program, model.use_native_decode = True, True
        if model.native_decode is None:
            print("(this model has no C++ decode program: its row is the Python one)")
        report = ", ".join(f"{name} {statistics.median(v):.2f}"
                           + ("" if name == "forward" else f" ({statistics.median(f / x for f, x in zip(times['forward'], v)):.3f}x)")
                           for name, v in times.items())
        same = all(t == tokens["forward"] for t in tokens.values())
        print(f"batch {batch}: ms per step (median of {args.rounds}; rounds' ratio to forward) {report}; same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
