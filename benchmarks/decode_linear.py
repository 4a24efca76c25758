"""A decode step's matmuls in the CPU kernels' dense_linear against oneDNN's prepacked matmul, whole model.

    python benchmarks/decode_linear.py [--model PATH] [--dtype bfloat16] [--batches 1,2,4,8] [--rounds 9] [--tokens 64]

Loads the model (by default the embedded SmolLM2-135M) once and times greedy generation of --tokens tokens for
--batches requests at a time (32-token prompts), the decode rows taking dense_linear (where
PackedCPUWeight keeps its copy: tokenmill/layers/quantization/unquantized.py) or oneDNN, the two
alternating round by round in one process, since these machines are shared and noisy. Prints the
median milliseconds per step of each and checks both give the same tokens. Rows above
DECODE_MAX_ROWS take oneDNN either way, so a batch above it shows the noise floor.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.layers.quantization.unquantized import PackedCPUWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    flags = cpu_kernels.vector_flags()
    print(f"CPU flags: {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(int(b) for b in args.batches.split(",")))
    model = llm.llm_engine.executor.worker.runner.model
    # The C++ decode program holds the dense_linear copies it was built with; the Python one reads them per
    # call, so taking a copy away below reaches it.
    decoder = getattr(model, "model", None)
    if hasattr(decoder, "use_native_decode"):
        decoder.use_native_decode = False
    # (an LM head built dense_only keeps no oneDNN copy: it takes dense_linear in both rounds)
    packed = [w for m in model.modules() if isinstance(w := getattr(m, "packed_weight", None), PackedCPUWeight) and w.packed is not None]
    copies = [w.decode_packed for w in packed]
    print(f"dtype {next(model.parameters()).dtype}: {len(packed)} prepacked weights, "
          f"{sum(c is not None for c in copies)} with a copy for dense_linear", flush=True)
    if not any(c is not None for c in copies):
        raise SystemExit("no weight keeps a copy for dense_linear here (no CPU kernels, or no weight small enough): nothing to compare")

    def use(dense: bool) -> None:
        for weight, copy in zip(packed, copies):
            weight.decode_packed = copy if dense else None

    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(batch)]

        def run() -> tuple[float, list]:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return (time.perf_counter() - start) / args.tokens * 1e3, [o.outputs[0].token_ids for o in outputs]

        times: dict[str, list[float]] = {"oneDNN": [], "dense_linear": []}
        tokens = {}
        for _ in range(args.rounds):
            for name in times:
                use(name == "dense_linear")
                ms, tokens[name] = run()
                times[name].append(ms)
        use(True)
        medians = {name: statistics.median(v) for name, v in times.items()}
        print(f"batch {batch}: ms per step (median of {args.rounds}) oneDNN {medians['oneDNN']:.2f}, "
              f"dense_linear {medians['dense_linear']:.2f} ({medians['oneDNN'] / medians['dense_linear']:.2f}x); "
              f"same tokens: {tokens['oneDNN'] == tokens['dense_linear']}", flush=True)


if __name__ == "__main__":
    main()
