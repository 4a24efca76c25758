"""`tokenmill bench throughput | serve | latency`: options and commands.

The option names follow vLLM's `vllm bench` (--dataset-name is accepted for --dataset,
--output-json for --json). See tokenmill/bench/__init__.py for the workloads' command lines.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
from pathlib import Path

from tokenmill.bench.datasets import (
    DATASETS,
    SampleRequest,
    allowed_token_ids,
    check_at_least,
    check_fits,
    describe,
    ids_to_text,
    length_range,
    chat_dataset,
    edit_dataset,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)
from tokenmill.bench.report import args_dict, check_output_path, format_latency, format_throughput, write_json
from tokenmill.errors import TokenmillError


# -- options -------------------------------------------------------------------
def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("requests")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS,
                   help="random: random token ids; sharegpt: a ShareGPT JSON file (--dataset-path); "
                        "prefix: requests sharing a long common prefix; edit: chat requests to copy a passage of "
                        "shipped text with one word changed (where speculative decoding's prompt lookup pays; "
                        "--input-len sets the passage length); chat: open-ended chat prompts shipped with the "
                        "package, held out from train-medusa's (default: random)")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT-format JSON file for --dataset sharegpt")
    g.add_argument("--num-prompts", type=int, default=32, help="number of requests (default: 32)")
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens per request; edit: passage tokens (default: 128)")
    g.add_argument("--output-len", type=int, default=128, help="random, prefix, chat: output tokens per request (default: 128)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: draw lengths uniformly from [len*(1-r), len*(1+r)] (default: 0, fixed lengths)")
    g.add_argument("--min-input-len", type=int, default=None, help="random: lowest prompt length (overrides the ratio)")
    g.add_argument("--max-input-len", type=int, default=None, help="random: highest prompt length (overrides the ratio)")
    g.add_argument("--min-output-len", type=int, default=None, help="random: lowest output length (overrides the ratio)")
    g.add_argument("--max-output-len", type=int, default=None, help="random: highest output length (overrides the ratio)")
    g.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens of the shared prefix (default: 1024)")
    g.add_argument("--suffix-len", type=int, default=32, help="prefix: tokens of each request's own suffix (default: 32)")
    g.add_argument("--num-prefixes", type=int, default=1, help="prefix: number of different shared prefixes (default: 1)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens per request (default: the length of the conversation's answer)")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset draws and the arrival times (default: 0)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: EOS is ignored, so every request makes its full output length)")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--json", "--output-json", dest="json", default=None, metavar="PATH",
                   help="write the arguments and the results to this JSON file")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def _add_baseline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("baseline")
    g.add_argument("--baseline", choices=["hf"], default=None,
                   help="hf: also run HF transformers generate on the same requests (static batches, left "
                        "padding, same dtype and device) and print the ratio")
    g.add_argument("--hf-batch-size", type=int, default=32,
                   help="requests per HF static batch (0: all in one batch; default: 32)")


def add_bench_parser(sub) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, latency, startup, perplexity",
                           description="Benchmarks: offline throughput, an OpenAI-compatible server, latency of one batch.")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="{throughput,serve,latency,startup,perplexity}")

    tp = bsub.add_parser("throughput", help="offline throughput of the engine on a dataset",
                         description="Offline throughput: all requests go to the engine at once (greedy, EOS ignored); "
                                     "reports requests/s, input/output/total tokens/s, peak KV cache usage and TTFT.")
    add_engine_args(tp)
    _add_dataset_args(tp)
    tp.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the short warm-up request")
    g = tp.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (default: 0, greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: 1, off)")
    g.add_argument("--top-k", type=int, default=0, help="every request's top_k (default: 0, off)")
    _add_baseline_args(tp)
    _add_output_args(tp)
    tp.set_defaults(func=cmd_throughput)

    lat = bsub.add_parser("latency", help="prefill time and per-token decode time of one batch",
                          description="Latency of one batch of identical-length requests: prefill time (until every "
                                      "request has its first token) and decode time per token; medians over --num-iters.")
    add_engine_args(lat)
    g = lat.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default: 8)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    g.add_argument("--num-iters-warmup", type=int, default=2, help="iterations not measured (default: 2)")
    g.add_argument("--num-iters", type=int, default=5, help="measured iterations (default: 5)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    _add_baseline_args(lat)
    _add_output_args(lat)
    lat.set_defaults(func=cmd_latency)

    ppl = bsub.add_parser("perplexity", help="perplexity on a fixed text (the cost of quantization in accuracy)",
                          description="Perplexity through the engine (prompt logprobs) on a fixed text cut into windows, "
                                      "each scored from its start; the default text is the US Constitution (public domain).")
    add_engine_args(ppl)
    g = ppl.add_argument_group("text")
    g.add_argument("--text", default=None, metavar="PATH", help="a UTF-8 text file (default: the US Constitution shipped with tokenmill)")
    g.add_argument("--window", type=int, default=512, help="tokens per window (default: 512)")
    _add_output_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)

    st = bsub.add_parser("startup", help="time from the command to the first token, and to a healthy server",
                         description="Start-up time, each run in a fresh process: command to first token (split into "
                                     "interpreter, import, LLM() and first token) and, with --serve, `tokenmill serve` "
                                     "to a healthy /health; medians over --num-runs.")
    g = st.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g = st.add_argument_group("runs")
    g.add_argument("--num-runs", type=int, default=3, help="fresh processes per measurement (default: 3)")
    g.add_argument("--serve", action="store_true", help="also time `tokenmill serve` until /health answers 200")
    g.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")
    _add_output_args(st)
    st.set_defaults(func=cmd_startup)

    srv = bsub.add_parser("serve", help="benchmark an OpenAI-compatible server (ours or another engine's)",
                          description="Streams requests to an OpenAI-compatible server with Poisson arrivals; reports "
                                      "request and token throughput and mean/median/percentiles of TTFT, TPOT, ITL and "
                                      "end-to-end latency, as vLLM's `bench serve` does.")
    g = srv.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="the server's URL, e.g. http://127.0.0.1:8000 (default: from --host and --port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="the model name sent in requests (default: the first of GET /v1/models); a local model "
                        "path is also used for the tokenizer")
    g.add_argument("--served-model-name", default=None, help="send this model name instead of --model")
    g.add_argument("--tokenizer", default=None,
                   help="HF folder or GGUF file whose tokenizer makes the prompts (default: --model if it is a "
                        "local path, else the embedded SmolLM2's)")
    g.add_argument("--prompt-format", choices=["ids", "text"], default=None,
                   help="send prompts as token ids (exact lengths; default for completions) or as text (decoded; "
                        "the only choice for chat)")
    g.add_argument("--extra-body", default=None, metavar="JSON", help="extra fields for every request body, as a JSON object")
    g.add_argument("--request-timeout", type=float, default=None, help="seconds one request may take (default: no limit)")
    g = srv.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more even (default: 1)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    _add_dataset_args(srv)
    g = srv.add_argument_group("metrics")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el (default: all)")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99 (default: 99)")
    srv.add_argument("--verbose", "-v", action="store_true", help="log details to stderr")
    _add_output_args(srv)
    srv.set_defaults(func=cmd_serve)


# -- requests ------------------------------------------------------------------
def _excluded_ids(tokenizer, eos_ids=()) -> set[int]:
    """Token ids random prompts avoid: the tokenizer's special tokens and the model's EOS ids."""
    special = set(eos_ids)
    if tokenizer is not None:
        special.update(int(t) for t in (getattr(tokenizer, "all_special_ids", None) or []))
    return special


def build_requests(args: argparse.Namespace, tokenizer, vocab_size: int, exclude, max_model_len: int | None) -> list[SampleRequest]:
    """The benchmark's requests from the dataset options."""
    if args.dataset == "random":
        input_range = length_range("input", args.input_len, args.random_range_ratio, args.min_input_len, args.max_input_len)
        output_range = length_range("output", args.output_len, args.random_range_ratio, args.min_output_len, args.max_output_len)
        return random_dataset(args.num_prompts, vocab_size, input_range, output_range, args.seed, exclude)
    if args.dataset == "prefix":
        return prefix_dataset(
            args.num_prompts, vocab_size, args.prefix_len, args.suffix_len, args.output_len, args.seed, args.num_prefixes, exclude
        )
    if args.dataset == "edit":
        return edit_dataset(tokenizer, args.num_prompts, args.input_len, args.seed)
    if args.dataset == "chat":
        return chat_dataset(tokenizer, args.num_prompts, args.output_len, args.seed)
    return sharegpt_dataset(args.dataset_path, tokenizer, args.num_prompts, args.seed, args.sharegpt_output_len, max_model_len)


def precheck_dataset_args(args: argparse.Namespace) -> None:
    """The dataset mistakes that can be found before a model is loaded or a server contacted."""
    check_at_least("--num-prompts", args.num_prompts, 1)
    if args.dataset == "random":
        length_range("input", args.input_len, args.random_range_ratio, args.min_input_len, args.max_input_len)
        length_range("output", args.output_len, args.random_range_ratio, args.min_output_len, args.max_output_len)
    elif args.dataset == "sharegpt":
        if not args.dataset_path:
            raise TokenmillError("--dataset sharegpt needs --dataset-path: a ShareGPT-format JSON file")
        if not os.path.isfile(args.dataset_path):
            raise TokenmillError(f"--dataset-path {args.dataset_path}: no such file")


def _warmup_prompt(vocab_size: int, exclude, max_model_len: int, seed: int) -> list[int]:
    import numpy as np

    allowed = allowed_token_ids(vocab_size, exclude)
    length = max(1, min(16, max_model_len - 5))
    return np.random.default_rng(seed + 1_000_003).choice(allowed, size=length).tolist()


def _free_memory() -> None:
    """Collect the dropped engine's model and KV cache before the HF model is loaded."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _check_baseline(args: argparse.Namespace) -> None:
    if args.baseline == "hf" and args.hf_batch_size < 0:
        raise ValueError(f"--hf-batch-size must be >= 0, got {args.hf_batch_size}")
    if args.baseline == "hf" and not getattr(args, "ignore_eos", True):
        raise ValueError("--baseline hf compares fixed output lengths; drop --no-ignore-eos")
    if args.baseline == "hf" and getattr(args, "temperature", 0.0) != 0.0:
        raise ValueError("--baseline hf decodes greedily; drop --temperature")


def _sampling_params(args: argparse.Namespace) -> dict:
    """bench throughput's sampling options as SamplingParams keywords, checked by SamplingParams itself."""
    from tokenmill.sampling_params import SamplingParams

    values = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    SamplingParams(**values)  # a bad value is its one-line error before any model loads
    return values


def _load_engine(args: argparse.Namespace):
    """An LLMEngine, or with --data-parallel-size N the replicas' front end (the same step interface)."""
    from tokenmill.engine.dp.engine import DataParallelEngine
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.entrypoints.cli import engine_config_from_args

    config = engine_config_from_args(args)
    engine = DataParallelEngine(config) if config.parallel.data_parallel_size > 1 else LLMEngine(config)
    _wait_until_warm(engine)
    return engine


def _wait_until_warm(engine) -> None:
    """Let the target's weights move into huge pages and the KV caches' pages fault in first (worker/cpu_memory.py's
    WeightMove and KVPrefault, rank 0's: the target's and a draft model's), so the timed runs see the engine as
    it runs once warm, as vLLM's and llama.cpp's are: they fill their caches at start."""
    worker = getattr(getattr(engine, "executor", None), "worker", None)
    if worker is not None:
        worker.finish_weight_move()
    pending = [p for p in (worker.kv_prefaults() if worker is not None else []) if not p.wait(0)]
    if pending:
        print("faulting in the KV cache's pages before timing...", file=sys.stderr)
        for prefault in pending:
            prefault.wait()


def _engine_info(engine) -> dict:
    return {
        "model": getattr(engine, "model_name", None),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "quantization": engine.config.model.quantization or "none",
        "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
        "device": str(engine.device),
    }


# -- commands ------------------------------------------------------------------
def cmd_throughput(args: argparse.Namespace) -> None:
    from tokenmill.bench.throughput import run_throughput, warm_up

    use_tqdm = not args.disable_tqdm
    check_output_path(args.json)
    _check_baseline(args)
    sampling = _sampling_params(args)
    precheck_dataset_args(args)
    engine = _load_engine(args)
    exclude = _excluded_ids(engine.tokenizer, engine.eos_token_ids)
    requests = build_requests(args, engine.tokenizer, engine.vocab_size, exclude, engine.max_model_len)
    check_fits(requests, engine.max_model_len)
    if args.warmup:
        warm_up(engine, _warmup_prompt(engine.vocab_size, exclude, engine.max_model_len, args.seed))
    ours = run_throughput(engine, requests, ignore_eos=args.ignore_eos, use_tqdm=use_tqdm, sampling=sampling)
    result = {
        "benchmark": "throughput",
        **_engine_info(engine),
        "dataset_name": args.dataset,
        "prefix_caching": args.enable_prefix_caching,
        "dataset": describe(requests),
        "tokenmill": ours,
        "args": args_dict(args),
    }
    if args.baseline == "hf":
        from tokenmill.bench.hf_baseline import hf_throughput, load_hf_model

        dtype, device = engine.dtype, engine.device
        engine = None
        _free_memory()
        model = load_hf_model(args.model, dtype, device)
        hf = hf_throughput(model, requests, args.hf_batch_size or None, device, use_tqdm=use_tqdm)
        result["hf"] = hf
        result["ratio"] = {
            key: ours[key] / hf[key] if hf[key] else None
            for key in ("requests_per_second", "input_tokens_per_second", "output_tokens_per_second", "tokens_per_second")
        }
    print(format_throughput(result))
    write_json(args.json, result)


def cmd_startup(args: argparse.Namespace) -> None:
    from tokenmill.bench.startup import engine_kwargs_from_args, format_startup, run_startup, serve_args_from_args

    check_output_path(args.json)
    check_at_least("--num-runs", args.num_runs, 1)
    result = run_startup(engine_kwargs_from_args(args), serve_args_from_args(args), args.num_runs, args.serve)
    result["args"] = args_dict(args)
    print(format_startup(result))
    write_json(args.json, result)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from tokenmill.bench.perplexity import DEFAULT_TEXT, run_perplexity
    from tokenmill.bench.report import format_perplexity
    from tokenmill.entrypoints.cli import engine_config_from_args
    from tokenmill.llm import LLM

    check_output_path(args.json)
    if args.window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {args.window}")
    path = Path(args.text) if args.text else DEFAULT_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--text {path}: {exc}") from None
    llm = LLM.from_config(engine_config_from_args(args))
    if args.window > llm.llm_engine.max_model_len:
        raise ValueError(f"--window {args.window} is more than the context length {llm.llm_engine.max_model_len}")
    ppl = run_perplexity(llm, text, args.window)
    result = {
        "benchmark": "perplexity",
        **_engine_info(llm.llm_engine),
        "text": str(path),
        "window": args.window,
        "perplexity": ppl.perplexity,
        "mean_nll": ppl.mean_nll,
        "tokens_scored": ppl.tokens_scored,
        "windows": ppl.windows,
        "seconds": ppl.seconds,
        "args": args_dict(args),
    }
    print(format_perplexity(result))
    write_json(args.json, result)


def cmd_latency(args: argparse.Namespace) -> None:
    from tokenmill.bench.latency import check_latency_args, engine_latency_iteration, latency_prompts, run_latency
    from tokenmill.bench.throughput import spec_decode_delta

    use_tqdm = not args.disable_tqdm
    check_output_path(args.json)
    _check_baseline(args)
    check_latency_args(args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup)
    if args.batch_size > args.max_num_seqs:
        raise ValueError(f"--batch-size {args.batch_size} is more than --max-num-seqs {args.max_num_seqs}: the batch would not run at once")
    engine = _load_engine(args)
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} is more than the context length {engine.max_model_len}"
        )
    exclude = _excluded_ids(engine.tokenizer, engine.eos_token_ids)
    batches = latency_prompts(
        engine.vocab_size, args.batch_size, args.input_len, args.num_iters_warmup + args.num_iters, args.seed, exclude
    )
    spec_before = engine.stats().spec_decode
    ours = run_latency(lambda b: engine_latency_iteration(engine, b, args.output_len), batches, args.num_iters_warmup, "Latency", use_tqdm)
    if spec_before is not None:  # over the warm-up and measured iterations alike
        ours["spec_decode"] = spec_decode_delta(spec_before, engine.stats().spec_decode)
    result = {
        "benchmark": "latency",
        **_engine_info(engine),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters_warmup": args.num_iters_warmup,
        "tokenmill": ours,
        "args": args_dict(args),
    }
    if args.baseline == "hf":
        from tokenmill.bench.hf_baseline import hf_latency_iteration, load_hf_model

        dtype, device = engine.dtype, engine.device
        engine = None
        _free_memory()
        model = load_hf_model(args.model, dtype, device)
        hf = run_latency(
            lambda b: hf_latency_iteration(model, b, args.output_len, device), batches, args.num_iters_warmup, "HF latency", use_tqdm
        )
        result["hf"] = hf
        result["ratio"] = {
            key: hf[key] / ours[key] if ours[key] else None
            for key in ("prefill_time_ms", "decode_time_per_token_ms", "median_latency")
        }
    print(format_latency(result))
    write_json(args.json, result)


def _parse_list(text: str, name: str, cast):
    try:
        values = [cast(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def _serve_tokenizer(args: argparse.Namespace):
    """(tokenizer or None, vocab size, EOS ids) from --tokenizer, a local --model path, or the embedded model."""
    from tokenmill.config import ModelConfig
    from tokenmill.loader import load_model_source

    path = args.tokenizer or (args.model if args.model and os.path.exists(args.model) else None)
    source = load_model_source(ModelConfig(model=path))
    return source.tokenizer, int(source.hf_config.vocab_size), set(source.eos_token_ids)


def cmd_serve(args: argparse.Namespace) -> None:
    from tokenmill.bench.metrics import SERVE_METRICS, format_serve_metrics, serve_metrics
    from tokenmill.bench.serve import ServeRequest, is_chat, run_serve

    use_tqdm = not args.disable_tqdm
    check_output_path(args.json)
    if not args.endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path such as /v1/completions, got {args.endpoint!r}")
    chat = is_chat(args.endpoint)
    prompt_format = args.prompt_format or ("text" if chat else "ids")
    if chat and prompt_format == "ids":
        raise ValueError("--endpoint /v1/chat/completions takes text prompts: use --prompt-format text")
    selected = _parse_list(args.percentile_metrics, "--percentile-metrics", str)
    bad = [m for m in selected if m not in SERVE_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)}; choose from {', '.join(SERVE_METRICS)}")
    percentiles = _parse_list(args.metric_percentiles, "--metric-percentiles", float)
    if any(not 0 <= q <= 100 for q in percentiles):
        raise ValueError(f"--metric-percentiles must lie in [0, 100], got {args.metric_percentiles}")
    extra_body = None
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    precheck_dataset_args(args)

    tokenizer, vocab_size, eos_ids = _serve_tokenizer(args)
    if prompt_format == "text" and tokenizer is None:
        raise TokenmillError("--prompt-format text needs a tokenizer, and this model has none (give --tokenizer)")
    requests = build_requests(args, tokenizer, vocab_size, _excluded_ids(tokenizer, eos_ids), None)

    def to_serve(r: SampleRequest, output_len: int | None = None) -> ServeRequest:
        output_len = r.output_len if output_len is None else output_len
        if prompt_format == "ids":
            return ServeRequest(list(r.prompt_token_ids), r.prompt_len, output_len)
        if r.prompt is not None:
            return ServeRequest(r.prompt, r.prompt_len, output_len)
        text, length = ids_to_text(tokenizer, r.prompt_token_ids)
        return ServeRequest(text, length, output_len)

    serve_requests = [to_serve(r) for r in requests]
    probe_source = SampleRequest(requests[0].prompt_token_ids[:8], 2)
    probe = to_serve(probe_source)
    if isinstance(probe.prompt, str) and not probe.prompt.strip():
        probe = ServeRequest("Hello", 1, 2)
    rate = args.request_rate
    model, results, duration = asyncio.run(
        run_serve(
            base_url,
            args.endpoint,
            args.served_model_name or args.model,
            serve_requests,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            extra_body=extra_body,
            probe=probe,
            timeout=args.request_timeout,
            use_tqdm=use_tqdm,
        )
    )
    metrics = serve_metrics(results, duration, percentiles, selected)
    extra = {"Request rate configured (RPS):": f"{rate:.2f}"}
    if args.max_concurrency is not None:
        extra["Maximum request concurrency:"] = args.max_concurrency
    print(format_serve_metrics(metrics, percentiles, selected, extra))
    errors = [r.error for r in results if not r.success]
    if errors:
        distinct = list(dict.fromkeys(errors))
        print(f"{len(errors)} of {len(results)} requests failed; first errors:", file=sys.stderr)
        for error in distinct[:5]:
            print(f"  {error}", file=sys.stderr)
    result = {
        "benchmark": "serve",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "dataset_name": args.dataset,
        "prompt_format": prompt_format,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
        "args": args_dict(args),
    }
    write_json(args.json, result)
