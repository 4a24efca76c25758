"""`tokenmill serve` options: the engine's (shared with generate / chat / bench) and the server's."""

from __future__ import annotations

import argparse
import os

from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tokenmill.entrypoints.openai.render_limits import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_MAX_RENDER_SECONDS
from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 10 << 20  # 10 MiB
DEFAULT_MAX_N = 128  # OpenAI's own cap on n
DEFAULT_MAX_PROMPTS = 1024  # prompts in one /v1/completions request
DEFAULT_BODY_READ_TIMEOUT = 15.0  # seconds to receive a request body


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def api_keys_from_env(value: str | None) -> list[str] | None:
    """$TOKENMILL_API_KEY: one key, or several separated by commas (None: no keys)."""
    keys = [k.strip() for k in (value or "").split(",") if k.strip()]
    return keys or None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key", nargs="+", default=api_keys_from_env(os.environ.get("TOKENMILL_API_KEY")), metavar="KEY",
        help="require 'Authorization: Bearer <key>' on the API routes, any of these keys "
        "(default: $TOKENMILL_API_KEY, comma-separated; none: open)",
    )
    g.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="the model name(s) clients use in 'model' (default: the --model value, or the default model's name)",
    )
    g.add_argument(
        "--max-waiting-requests", type=_positive_int, default=None,
        help="answer 503 when this many requests are already waiting for the engine (default: no limit)",
    )
    g.add_argument(
        "--request-timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="abort a request that runs longer than this (HTTP 504, or an error event in a stream; default: none)",
    )
    g.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
        help=f"refuse larger request bodies with 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )
    g.add_argument(
        "--max-n", type=_positive_int, default=DEFAULT_MAX_N,
        help=f"refuse n or best_of above this with 400 (default: {DEFAULT_MAX_N}, OpenAI's cap)",
    )
    g.add_argument(
        "--max-prompts-per-request", type=_positive_int, default=DEFAULT_MAX_PROMPTS,
        help=f"refuse a completions request with more prompts in its list with 400 (default: {DEFAULT_MAX_PROMPTS})",
    )
    g.add_argument(
        "--request-body-timeout", type=_positive_float, default=DEFAULT_BODY_READ_TIMEOUT, metavar="SECONDS",
        help=f"answer 408 when a request body takes longer to arrive (default: {DEFAULT_BODY_READ_TIMEOUT:g})",
    )
    g.add_argument(
        "--max-prompt-tokens", type=_positive_int, default=None, metavar="N",
        help="refuse prompts (each of a list; a chat once rendered) of more tokens with 400 (default: the context length)",
    )
    g.add_argument(
        "--max-concurrent-requests", type=_positive_int, default=None, metavar="N",
        help="answer 429 (with Retry-After) to requests beyond this many in flight, streams included (default: no limit)",
    )
    g.add_argument(
        "--max-concurrent-requests-per-key", type=_positive_int, default=None, metavar="N",
        help="the same per API key, or per client address without --api-key (default: no limit)",
    )
    g.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="accept a chat_template sent with a request (it is code the server runs; default: refused with 400)",
    )
    g.add_argument(
        "--max-chat-template-render-seconds", type=_positive_float, default=DEFAULT_MAX_RENDER_SECONDS, metavar="SECONDS",
        help=f"stop a chat template render that runs longer, with 400 (default: {DEFAULT_MAX_RENDER_SECONDS:g})",
    )
    g.add_argument(
        "--max-chat-template-output-chars", type=_positive_int, default=DEFAULT_MAX_OUTPUT_CHARS, metavar="N",
        help=f"stop a chat template render that writes more characters, with 400 (default: {DEFAULT_MAX_OUTPUT_CHARS})",
    )
    g.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format, read for tool_choice 'auto' (with --enable-auto-tool-choice): "
        "hermes (Qwen2.5/3, Hermes), llama3_json, mistral, pythonic (default: none)",
    )
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="let the model decide when to call tools (tool_choice 'auto', the default when tools are sent); "
        "needs --tool-call-parser. 'required' and named tool choices work without it (structured output)",
    )
    g.add_argument(
        "--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> off into reasoning_content: qwen3, deepseek_r1 (default: none)",
    )
    g.add_argument(
        "--timeout-graceful-shutdown", type=_non_negative_float, default=10.0, metavar="SECONDS",
        help="on SIGTERM / SIGINT, let in-flight requests finish for this long, then abort them (default: 10)",
    )
    g.add_argument("--no-ui", action="store_true", help="no chat page at GET / (default: served, outside the --api-key check)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="tokenmill's log level")
    g.add_argument("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    g.add_argument("--disable-access-log", action="store_true", help="no log line per request")


def add_serve_parser(sub) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/models) plus /health, /metrics, /version, /tokenize, /detokenize, and a chat page at /.",
    )
    add_engine_args(serve)
    add_server_args(serve)

    def run(args: argparse.Namespace) -> None:
        from tokenmill.entrypoints.openai.serve_start import serve

        serve(args)

    serve.set_defaults(func=run)
