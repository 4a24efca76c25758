"""Benchmarks: `tokenmill bench throughput | serve | latency`.

    tokenmill bench throughput [engine options] [--dataset random|sharegpt|prefix ...] [--baseline hf] [--json PATH]
    tokenmill bench serve --base-url http://127.0.0.1:8000 [--endpoint /v1/completions] [--request-rate R]
                          [--max-concurrency N] [dataset options] [--json PATH]
    tokenmill bench latency [engine options] --batch-size B --input-len I --output-len O [--baseline hf]

Engine options are those of `tokenmill generate` (--model, --dtype, --max-num-seqs,
--no-prefix-caching, ...). Every request is greedy and ignores EOS (`--no-ignore-eos` to stop at
EOS), so each makes exactly its output length. Progress bars go to stderr (`--disable-tqdm`).

The workloads of issue 5, as command lines (the default model is the embedded SmolLM2-135M;
add --model PATH for another):

A. 32 requests, 128 prompt tokens, 128 output tokens (the defaults of `bench throughput`):

    tokenmill bench throughput --dataset random --num-prompts 32 --input-len 128 --output-len 128 --baseline hf --json a.json

B. 200 requests, prompt and output lengths uniform in [16, 512]:

    tokenmill bench throughput --dataset random --num-prompts 200 \\
        --min-input-len 16 --max-input-len 512 --min-output-len 16 --max-output-len 512 --baseline hf --json b.json

C. 64 requests sharing a 1,024-token prefix, 32-token unique suffixes; mean TTFT with and without
   prefix caching (the output length is not part of the workload; 32 keeps the run short):

    tokenmill bench throughput --dataset prefix --num-prompts 64 --prefix-len 1024 --suffix-len 32 --output-len 32 --json c-cache.json
    tokenmill bench throughput --dataset prefix --num-prompts 64 --prefix-len 1024 --suffix-len 32 --output-len 32 --no-prefix-caching --json c-nocache.json

The same workloads against a running server (ours: `tokenmill serve`, or vLLM, llama.cpp, ...),
all at once or with Poisson arrivals:

    tokenmill bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 --input-len 128 --output-len 128
    tokenmill bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --min-input-len 16 --max-input-len 512 \\
        --min-output-len 16 --max-output-len 512 --request-rate 4 --max-concurrency 64
    tokenmill bench serve --base-url http://127.0.0.1:8000 --dataset prefix --num-prompts 64 --prefix-len 1024 --suffix-len 32 --output-len 32

Latency of one batch (prefill time, decode time per token), with the HF ratio:

    tokenmill bench latency --batch-size 8 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5 --baseline hf

Modules: datasets (requests), metrics (percentiles, serving metrics, arrival schedule),
throughput / latency (the engine side), serve (the HTTP client), hf_baseline (transformers
generate), report (tables and JSON), cli (options and commands). benchmarks/peers.py runs the
workloads on peer engines (vLLM CPU, llama.cpp, HF) side by side.
"""
