"""`tokenmill bench latency`: one batch of identical-length requests, prefill time and per-token decode time.

Each iteration adds --batch-size requests of --input-len random tokens (fresh tokens every
iteration, so the prefix cache never turns a prefill into a lookup) asking for exactly
--output-len tokens. Prefill time runs from adding the batch until every request has its first
token; decode time per token is the rest of the run over the remaining output_len - 1 tokens.
Warm-up iterations are run first and not counted; the medians of the measured ones are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np
from tqdm.auto import tqdm

from tokenmill.bench.datasets import allowed_token_ids, check_at_least
from tokenmill.bench.metrics import percentile
from tokenmill.sampling_params import SamplingParams

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's bench latency


def check_latency_args(batch_size: int, input_len: int, output_len: int, num_iters: int, num_iters_warmup: int) -> None:
    check_at_least("--batch-size", batch_size, 1)
    check_at_least("--input-len", input_len, 1)
    check_at_least("--output-len", output_len, 1)
    check_at_least("--num-iters", num_iters, 1)
    check_at_least("--num-iters-warmup", num_iters_warmup, 0)


def latency_prompts(vocab_size: int, batch_size: int, input_len: int, count: int, seed: int, exclude: Iterable[int] = ()) -> list[list[list[int]]]:
    """count batches of batch_size random prompts of input_len tokens each, all different."""
    allowed = allowed_token_ids(vocab_size, exclude)
    rng = np.random.default_rng(seed)
    return [[rng.choice(allowed, size=input_len).tolist() for _ in range(batch_size)] for _ in range(count)]


def engine_latency_iteration(engine, prompts: list[list[int]], output_len: int) -> dict:
    """One batch through the engine: prefill time, decode time per token, total latency (seconds)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = []
    start = time.perf_counter()
    try:
        for p in prompts:
            ids.append(engine.add_request({"prompt_token_ids": p}, params))
        started: set[str] = set()
        prefill = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
            if prefill is None and len(started) == len(ids):
                prefill = now - start
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    total = time.perf_counter() - start
    prefill = total if prefill is None else prefill
    decode = (total - prefill) / (output_len - 1) if output_len > 1 else 0.0
    return {"prefill": prefill, "decode_per_token": decode, "latency": total}


def run_latency(
    iteration: Callable[[list[list[int]]], dict],
    batches: list[list[list[int]]],
    num_iters_warmup: int,
    desc: str,
    use_tqdm: bool = True,
) -> dict:
    """Warm-up iterations, then the measured ones; medians (ms) and vLLM's latency percentiles (s)."""
    for batch in tqdm(batches[:num_iters_warmup], desc=f"{desc} warm-up", disable=not use_tqdm, dynamic_ncols=True):
        iteration(batch)
    runs = [iteration(batch) for batch in tqdm(batches[num_iters_warmup:], desc=desc, disable=not use_tqdm, dynamic_ncols=True)]
    return summarize_latency(runs, batch_size=len(batches[0]), input_len=len(batches[0][0]))


def summarize_latency(runs: list[dict], batch_size: int, input_len: int) -> dict:
    prefill = statistics.median(r["prefill"] for r in runs)
    decode = statistics.median(r["decode_per_token"] for r in runs)
    latencies = [r["latency"] for r in runs]
    out = {
        "num_iters": len(runs),
        "prefill_time_ms": prefill * 1000.0,
        "decode_time_per_token_ms": decode * 1000.0,
        "prefill_tokens_per_second": batch_size * input_len / prefill if prefill > 0 else 0.0,
        "decode_tokens_per_second": batch_size / decode if decode > 0 else 0.0,
        "avg_latency": statistics.fmean(latencies),  # seconds, as vLLM's JSON
        "median_latency": statistics.median(latencies),
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in LATENCY_PERCENTILES},
        "prefill_times": [r["prefill"] for r in runs],
        "decode_times_per_token": [r["decode_per_token"] for r in runs],
    }
    return out
