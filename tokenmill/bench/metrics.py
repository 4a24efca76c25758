"""Metric arithmetic shared by the benchmarks: percentiles, serving metrics, arrival schedules.

Pure functions on plain numbers (seconds in, milliseconds out where vLLM reports ms), so the
tests check them on synthetic timings. The serving metrics follow vLLM's `bench serve`
(benchmarks/serve.py calculate_metrics): same definitions, same JSON keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation as numpy's default; 0.0 for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def format_percentile(q: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's key spelling: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(q)) if float(q).is_integer() else str(q)


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """mean, median, std and the given percentiles of timings in seconds, in milliseconds."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        out = {"mean": 0.0, "median": 0.0, "std": 0.0}
        out.update({f"p{format_percentile(q)}": 0.0 for q in percentiles})
        return out
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{format_percentile(q)}": float(np.percentile(arr, q)) for q in percentiles})
    return out


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: vLLM's schedule. The first goes at 0; the gaps
    are drawn from a gamma distribution of shape `burstiness` and mean 1/request_rate (burstiness 1 is a
    Poisson process; lower is burstier, higher more even). An infinite rate sends everything at once."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=max(num_requests - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist() if num_requests else []


@dataclass
class RequestResult:
    """What the client saw of one served request (times in seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # from the server's usage if it sent one, else the number of content chunks
    ttft: float = 0.0  # request sent -> first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    latency: float = 0.0  # request sent -> last content chunk
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # when it was sent, from the start of the run


def serve_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (99,),
    selected: Sequence[str] = SERVE_METRICS,
) -> dict:
    """vLLM's serving metrics: totals, throughputs, and mean/median/std/percentiles (ms) of TTFT, TPOT
    (e2e minus TTFT over the output tokens after the first, for requests with more than one), ITL (every
    gap between content chunks, all requests pooled) and end-to-end latency. Failed requests count only
    as failures."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    duration = max(duration, 1e-9)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name in selected:
        if name not in series:
            raise ValueError(f"unknown metric {name!r}; choose from {', '.join(SERVE_METRICS)}")
        for stat, value in summarize(series[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def format_serve_metrics(m: dict, percentiles: Sequence[float] = (99,), selected: Sequence[str] = SERVE_METRICS, extra: dict | None = None) -> str:
    """The result block in vLLM's layout, so figures compare line by line."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        text = format(value, fmt) if fmt else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    for label, value in (extra or {}).items():
        row(label, value)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for name in selected:
        title, short = _METRIC_TITLES[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], ".2f")
        for q in percentiles:
            p = format_percentile(q)
            row(f"P{p} {short} (ms):", m[f"p{p}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def throughput_metrics(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict:
    """Offline throughput, with vLLM's JSON keys (elapsed_time, requests_per_second, tokens_per_second) and ours."""
    elapsed = max(elapsed, 1e-9)
    total = input_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": total,
        "requests_per_second": num_requests / elapsed,
        "input_tokens_per_second": input_tokens / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "tokens_per_second": total / elapsed,
    }
