"""Human tables on stdout and the --json file."""

from __future__ import annotations

import argparse
import json
import math
import os

from tokenmill.errors import TokenmillError

WIDTH = 50


def _title(text: str, fill: str = "=") -> str:
    return "{s:{c}^{w}}".format(s=f" {text} " if text else "", c=fill, w=WIDTH)


def _model_line(result: dict) -> str:
    """The model, its dtype, its weights' quantization (when quantized), its KV cache's (when quantized) and the device."""
    quantization = result.get("quantization", "none")
    weights = f", {quantization} weights" if quantization != "none" else ""
    kv = result.get("kv_cache_dtype", "auto")
    kv_cache = f", {kv} KV cache" if kv != "auto" else ""
    return f"{result['model']} ({result['dtype']}{weights}{kv_cache}, {result['device']})"


def _row(label: str, value) -> str:
    return f"{label:<40} {value}"


def _num(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "-"


def _spec_decode_lines(spec: dict | None) -> list[str]:
    """Speculative decoding's figures, when it ran (vLLM's names: acceptance rate, mean acceptance length)."""
    if spec is None:
        return []
    per_pos = ", ".join(f"{n}" for n in spec["accepted_per_pos"]) or "-"
    return [
        _row("Spec decode drafts:", f"{spec['num_drafts']} ({spec['num_draft_tokens']} tokens)"),
        _row("Spec decode acceptance rate:", f"{100 * spec['acceptance_rate']:.1f}%"),
        _row("Spec decode mean accepted len:", _num(spec["mean_accepted_length"])),
        _row("Accepted per draft position:", per_pos),
    ]


def format_throughput(result: dict) -> str:
    m = result["tokenmill"]
    d = result["dataset"]
    lines = [_title("Offline Throughput Benchmark Result")]
    lines.append(_row("Model:", _model_line(result)))
    lines.append(
        _row(
            "Dataset:",
            f"{result['dataset_name']}: {d['num_requests']} requests, input {d['input_len_min']}-{d['input_len_max']}, "
            f"output {d['output_len_min']}-{d['output_len_max']} tokens",
        )
    )
    lines.append(_row("Prefix caching:", "on" if result["prefix_caching"] else "off"))
    lines.append(_row("Total input tokens:", m["total_input_tokens"]))
    lines.append(_row("Total output tokens:", m["total_output_tokens"]))
    lines.append(_row("Elapsed time (s):", _num(m["elapsed_time"])))
    lines.append(_row("Request throughput (req/s):", _num(m["requests_per_second"])))
    lines.append(_row("Input token throughput (tok/s):", _num(m["input_tokens_per_second"])))
    lines.append(_row("Output token throughput (tok/s):", _num(m["output_tokens_per_second"])))
    lines.append(_row("Total token throughput (tok/s):", _num(m["tokens_per_second"])))
    lines.append(_row("Peak KV cache usage:", f"{100 * m['peak_kv_cache_usage']:.1f}%"))
    lines.append(_row("Mean TTFT (ms):", _num(m["mean_ttft_ms"])))
    lines.append(_row("Median TTFT (ms):", _num(m["median_ttft_ms"])))
    lines.append(_row("P99 TTFT (ms):", _num(m["p99_ttft_ms"])))
    lines.append(_row("Prefix cache hit rate:", f"{100 * m['prefix_cache_hit_rate']:.1f}% of {m['prefix_cache_queries']} prompt tokens"))
    lines.append(_row("Median TPOT (ms):", _num(m.get("median_tpot_ms", 0.0))))
    lines.append(_row("Preemptions:", m["num_preemptions"]))
    lines.extend(_spec_decode_lines(m.get("spec_decode")))
    hf = result.get("hf")
    if hf is not None:
        lines.append(_title("HF transformers baseline", "-"))
        lines.append(_row("HF static batches:", f"{hf['num_batches']} of up to {hf['batch_size']} requests, left padded"))
        lines.append(f"{'':<32}{'tokenmill':>12}{'HF':>12}{'ratio':>10}")
        for label, key, higher_better in (
            ("Elapsed time (s)", "elapsed_time", False),
            ("Request throughput (req/s)", "requests_per_second", True),
            ("Input tokens/s", "input_tokens_per_second", True),
            ("Output tokens/s", "output_tokens_per_second", True),
            ("Total tokens/s", "tokens_per_second", True),
        ):
            ratio = _ratio(m[key], hf[key]) if higher_better else _ratio(hf[key], m[key])
            lines.append(f"{label:<32}{m[key]:>12.2f}{hf[key]:>12.2f}{ratio:>10}")
        lines.append("(ratio > 1: tokenmill is faster)")
    lines.append("=" * WIDTH)
    lines.append(
        f"Throughput: {m['requests_per_second']:.2f} requests/s, {m['tokens_per_second']:.2f} total tokens/s, "
        f"{m['output_tokens_per_second']:.2f} output tokens/s"
    )
    return "\n".join(lines)


def format_latency(result: dict) -> str:
    m = result["tokenmill"]
    lines = [_title("Latency Benchmark Result")]
    lines.append(_row("Model:", _model_line(result)))
    lines.append(_row("Batch:", f"{result['batch_size']} requests x {result['input_len']} prompt tokens, {result['output_len']} output tokens"))
    lines.append(_row("Iterations:", f"{m['num_iters']} (after {result['num_iters_warmup']} warm-up), medians"))
    lines.append(_row("Prefill time (ms):", _num(m["prefill_time_ms"])))
    lines.append(_row("Decode time per token (ms):", _num(m["decode_time_per_token_ms"])))
    lines.append(_row("Prefill throughput (tok/s):", _num(m["prefill_tokens_per_second"])))
    lines.append(_row("Decode throughput (tok/s):", _num(m["decode_tokens_per_second"])))
    lines.append(_row("Avg latency (s):", _num(m["avg_latency"], 4)))
    for q, value in m["percentiles"].items():
        lines.append(_row(f"{q}% percentile latency (s):", _num(value, 4)))
    lines.extend(_spec_decode_lines(m.get("spec_decode")))
    hf = result.get("hf")
    if hf is not None:
        lines.append(_title("HF transformers baseline", "-"))
        lines.append(f"{'':<32}{'tokenmill':>12}{'HF':>12}{'ratio':>10}")
        for label, key in (
            ("Prefill time (ms)", "prefill_time_ms"),
            ("Decode time per token (ms)", "decode_time_per_token_ms"),
            ("Median latency (s)", "median_latency"),
        ):
            lines.append(f"{label:<32}{m[key]:>12.3f}{hf[key]:>12.3f}{_ratio(hf[key], m[key]):>10}")
        lines.append("(ratio = HF time / tokenmill time; > 1: tokenmill is faster)")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_perplexity(result: dict) -> str:
    lines = [_title("Perplexity Result")]
    lines.append(_row("Model:", _model_line(result)))
    lines.append(_row("Text:", result["text"]))
    lines.append(_row("Windows:", f"{result['windows']} of up to {result['window']} tokens"))
    lines.append(_row("Tokens scored:", result["tokens_scored"]))
    lines.append(_row("Mean NLL (nats/token):", _num(result["mean_nll"], 4)))
    lines.append(_row("Perplexity:", _num(result["perplexity"], 4)))
    lines.append(_row("Time (s):", _num(result["seconds"])))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def jsonable(value):
    """Plain JSON: inf and nan become strings, tuples lists, other objects their str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def args_dict(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not callable(v)}


def check_output_path(path: str | None) -> None:
    """Fail before a long run, not after it, when the --json file cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise TokenmillError(f"--json {path}: the folder {folder} does not exist")
    if os.path.isdir(path):
        raise TokenmillError(f"--json {path}: is a directory")


def write_json(path: str | None, result: dict) -> None:
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(jsonable(result), handle, indent=2)
            handle.write("\n")
    except OSError as exc:
        raise TokenmillError(f"--json {path}: cannot be written ({exc.strerror or exc})") from None
