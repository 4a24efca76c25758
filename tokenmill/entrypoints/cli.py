"""`tokenmill generate | chat | serve | bench | train-medusa | train-eagle | calibrate-smoothquant`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.errors import TokenmillError
from tokenmill.gc_startup import long_lived_import
from tokenmill.sampling_params import SamplingParams


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's own")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--quantization", "-q", default=None, metavar="METHOD",
        help="quantize at load: int8 (W8A16, per channel), int4 (W4A16, group-wise) or w8a8 (int8 weights x int8 activations per token); "
        "or a pre-quantized checkpoint's gptq, awq, compressed-tensors (detected from its config.json when not given); CPU only",
    )
    g.add_argument(
        "--quantization-options", type=_json_object, default=None, metavar="JSON",
        help='options of the method, e.g. \'{"group_size": 64, "symmetric": true}\' for int4 (default: group 128, asymmetric)',
    )
    g.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 8}\'',
    )
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split every layer over N ranks (processes) that all-reduce per layer; on a CPU each rank gets its share of the cores")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="run N engine replicas, each with its share of the cores, behind one front end")
    g.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"], default=None,
                   help="where tensor-parallel ranks run: mp (spawned processes, the default for several) or ray (Ray actors)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    g.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="what the KV cache stores: auto (the model's dtype), int8 (a scale per token and KV head) or fp8 "
        "(e4m3, or e5m2; a per-tensor scale of 1.0): about 2x (16-bit models) or 4x (float32) the blocks in the same memory; CPU only",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)  # SchedulerConfig's (config.py imports torch)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
        help="turn off automatic prefix caching (reuse of the KV of prompt prefixes seen before)",
    )
    g.add_argument(
        "--no-cascade-attention", dest="cascade_attention", action="store_false",
        help="turn off cascade attention (decodes that share a cached prefix read it once per step for all of them)",
    )
    g.add_argument("--engine-seed", dest="engine_seed", type=int, default=0, help="seed of the engine's random draws")
    g.add_argument(
        "--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
        help="structured output: a grammar that takes longer to compile fails its request with an error naming this limit (default: 10)",
    )
    g.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="seed of the request's random stream")
    g.add_argument("--ignore-eos", action="store_true")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The model and engine options, shared by every subcommand that loads a model (serve and bench too)."""
    _add_engine_args(parser)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig that the options of add_engine_args describe."""
    from tokenmill.config import EngineConfig

    return EngineConfig.from_kwargs(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_options=args.quantization_options,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        cascade_attention=args.cascade_attention,
        seed=args.engine_seed,
        grammar_compile_timeout=args.grammar_compile_timeout,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def _engine(args: argparse.Namespace):
    from tokenmill.engine.engine import LLMEngine

    config = engine_config_from_args(args)
    if config.parallel.data_parallel_size > 1:
        # One prompt, or one conversation, runs on one engine: replicas would only add start-up time.
        raise TokenmillError(f"`tokenmill {args.command}` runs one engine: --data-parallel-size is for "
                             "`tokenmill serve`, `tokenmill bench` and LLM(data_parallel_size=N)")
    return LLMEngine(config)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _stream(engine, prompt, params: SamplingParams) -> str:
    """Run one request to the end, writing its text to stdout as it is generated."""
    engine.add_request(prompt, params)
    printed = 0
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    engine = _engine(args)
    sys.stdout.write(args.prompt)
    _stream(engine, args.prompt, params)
    sys.stdout.write("\n")


def cmd_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    engine = _engine(args)
    tokenizer = engine.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise TokenmillError("this model has no chat template; use `tokenmill generate` instead")
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with the model. Type /exit or press Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        reply = _stream(engine, {"prompt": text, "prompt_token_ids": ids}, params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def cmd_build_kernels(args: argparse.Namespace) -> None:
    """Build (or find) the CPU kernels ahead of time, so no later start pays for, or waits on, the build."""
    from tokenmill.kernels.cpu import load_cpu_kernels

    result = load_cpu_kernels()
    if not result.available:  # SystemExit with a message: exit status 1
        raise SystemExit(f"error: tokenmill's CPU kernels could not be built: {result.error}")
    verb = "built" if result.compiled else "found a finished build of"
    print(f"{verb} tokenmill's CPU kernels in {result.seconds:.3f} s: {result.path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A small, fast LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"tokenmill {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt", help="the text to continue")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="a system message")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    kernels = sub.add_parser("build-kernels", help="build tokenmill's CPU kernels ahead of time (else the first start builds them)")
    kernels.add_argument("--verbose", "-v", action="store_true", help="log build details to stderr")
    kernels.set_defaults(func=cmd_build_kernels)

    # serve, bench, train-medusa and train-eagle live with their code; each registers its own subcommand
    # (without importing torch: `tokenmill --help` answers in a fifth of a second).
    from tokenmill.bench.cli import add_bench_parser
    from tokenmill.entrypoints.openai.cli_args import add_serve_parser
    from tokenmill.training.cli import add_calibrate_smoothquant_parser, add_train_eagle_parser, add_train_medusa_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_train_medusa_parser(sub, _add_engine_args)
    add_train_eagle_parser(sub, _add_engine_args)
    add_calibrate_smoothquant_parser(sub, _add_engine_args)
    return parser


def _version() -> str:
    from tokenmill import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with long_lived_import("torch"):  # every command computes with torch: its objects frozen once imported (gc_startup)
        import torch  # noqa: F401
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (TokenmillError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
