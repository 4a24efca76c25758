"""Throughput of LLM.generate against HF transformers generate, same prompts, same process.

    python benchmarks/hf_compare.py --num-prompts 16 --input-len 64 --output-len 64

Both engines get the same token-id prompts, greedy decoding, and a fixed number of output
tokens (EOS ignored). HF runs one static batch with left padding. Prints output tokens/s
of each and the ratio; the median of --repeats runs is reported.

`tokenmill bench throughput --baseline hf` does the same on any dataset (and `bench latency
--baseline hf` for one batch); this script stays for its LLM.generate-level comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.hf_baseline import load_hf_model
    from tokenmill.loader.default_model import default_model_path

    path = args.model or default_model_path()
    dtype = getattr(torch, args.dtype)
    llm = LLM(model=path, dtype=args.dtype)
    hf = load_hf_model(path, dtype)  # the HF model on the GGUF's dequantized weights, as `--baseline hf` builds it

    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.vocab_size
    prompts = torch.randint(100, vocab - 100, (args.num_prompts, args.input_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    total_out = args.num_prompts * args.output_len

    def run_tokenmill() -> float:
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == total_out
        return elapsed

    def run_hf() -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == args.output_len
        return elapsed

    run_tokenmill(), run_hf()  # warm-up
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(run_tokenmill())
        theirs.append(run_hf())
    t_ours, t_hf = statistics.median(ours), statistics.median(theirs)
    print(f"workload: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"tokenmill LLM.generate : {total_out / t_ours:8.1f} output tok/s  (median of {args.repeats}: {t_ours:.2f} s)")
    print(f"HF transformers generate: {total_out / t_hf:8.1f} output tok/s  (median of {args.repeats}: {t_hf:.2f} s)")
    print(f"ratio tokenmill / HF    : {t_hf / t_ours:8.2f}x")


if __name__ == "__main__":
    main()
