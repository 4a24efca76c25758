"""`tokenmill bench throughput`: offline throughput of LLMEngine over a list of requests.

The engine is driven directly (add_request, then step until done) so that each step can sample
the KV-cache usage for its peak and each request's time to first token can be taken: from just
before its add_request to the end of the step that returned its first output token. All requests
are added at the start, as vLLM's throughput benchmark does. The peak KV-cache usage is the
largest engine.stats().kv_cache_usage seen after a step (blocks freed by requests that finished in
that step are already back, so it can be a little below the true peak inside the step).
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import summarize, throughput_metrics
from tokenmill.sampling_params import SamplingParams


def warm_up(engine, prompt: list[int], max_tokens: int = 4) -> None:
    """One short request per replica before the clock starts: the first forward passes pay one-time costs."""
    for _ in range(getattr(engine, "num_replicas", 1)):  # data parallel: the router gives each replica one
        engine.add_request({"prompt_token_ids": list(prompt)}, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_throughput(engine, requests: list[SampleRequest], ignore_eos: bool = True, use_tqdm: bool = True,
                   sampling: dict | None = None) -> dict:
    """Run every request to the end (greedy unless `sampling` gives SamplingParams keywords such as a temperature;
    max_tokens = its output length); throughput, TTFT, peak KV usage."""
    before = engine.stats()
    add_time: dict[str, float] = {}
    first_token: dict[str, float] = {}
    output_tokens: dict[str, int] = {}
    finish_time: dict[str, float] = {}
    peak_usage = before.kv_cache_usage
    num_steps = 0
    start = time.perf_counter()
    try:
        for r in requests:
            params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=r.output_len, ignore_eos=ignore_eos)
            t = time.perf_counter()
            add_time[engine.add_request({"prompt_token_ids": r.prompt_token_ids}, params)] = t
        generated = 0
        with tqdm(total=len(requests), desc="Throughput", unit="req", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.perf_counter()
                num_steps += 1
                peak_usage = max(peak_usage, engine.stats().kv_cache_usage)
                for out in outputs:
                    rid = out.request_id
                    generated += 1
                    if rid not in first_token and out.outputs and out.outputs[0].token_ids:
                        first_token[rid] = now
                    if out.finished:
                        output_tokens[rid] = len(out.outputs[0].token_ids)
                        finish_time[rid] = now
                        bar.update(1)
                bar.set_postfix_str(f"output {generated / max(now - start, 1e-9):.1f} tok/s", refresh=False)
    except BaseException:
        for rid in add_time:  # leave no request holding blocks
            engine.abort_request(rid)
        raise
    elapsed = time.perf_counter() - start
    after = engine.stats()
    metrics = throughput_metrics(
        len(requests), sum(r.prompt_len for r in requests), sum(output_tokens.values()), elapsed
    )
    ttfts = [first_token[rid] - t for rid, t in add_time.items() if rid in first_token]
    # Time per output token after the first, per request (vLLM's TPOT): what speculative decoding lowers.
    tpots = [
        (finish_time[rid] - first_token[rid]) / (output_tokens[rid] - 1)
        for rid in output_tokens if rid in first_token and output_tokens[rid] > 1
    ]
    ttft = summarize(ttfts, (99,))
    queries = getattr(after, "prefix_cache_queries", 0) - getattr(before, "prefix_cache_queries", 0)
    hits = getattr(after, "prefix_cache_hits", 0) - getattr(before, "prefix_cache_hits", 0)
    metrics.update(
        {
            "peak_kv_cache_usage": peak_usage,
            "mean_ttft_ms": ttft["mean"],
            "median_ttft_ms": ttft["median"],
            "p99_ttft_ms": ttft["p99"],
            "num_steps": num_steps,
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "median_tpot_ms": summarize(tpots, ())["median"],
        }
    )
    spec_before, spec_after = getattr(before, "spec_decode", None), getattr(after, "spec_decode", None)
    if spec_after is not None:
        metrics["spec_decode"] = spec_decode_delta(spec_before, spec_after)
    return metrics


def spec_decode_delta(before, after) -> dict:
    """Speculative decoding over a run: drafts, acceptance rate, mean accepted length, per-position acceptance."""
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0) for i, a in enumerate(after.accepted_per_pos)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        "accepted_per_pos": per_pos,
    }
