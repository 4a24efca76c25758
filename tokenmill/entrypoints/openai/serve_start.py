"""`tokenmill serve`'s start: the model loads while a thread imports the HTTP side.

FastAPI, the API's pydantic models and uvicorn take about a second to import, and the engine
needs none of them; so the flags are checked first (light registries only), then a thread imports
api_server while this thread builds the engine (whose weight loading spends its time in torch ops
that release the GIL), and the server starts as soon as both are ready.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
from types import ModuleType
from typing import Any

from tokenmill.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from tokenmill.entrypoints.openai.tool_parsers import get_tool_parser
from tokenmill.gc_startup import long_lived_import
from tokenmill.loader.source import in_background


def check_output_parsing(tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None) -> None:
    """ValueError for unknown parser names or --enable-auto-tool-choice without a parser."""
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


def make_server_engine(args: argparse.Namespace) -> Any:
    """The async engine `tokenmill serve` runs (several replicas: a data-parallel front end)."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.dp.async_engine import AsyncDataParallelEngine
    from tokenmill.entrypoints.cli import engine_config_from_args

    config = engine_config_from_args(args)
    engine_class = AsyncDataParallelEngine if config.parallel.data_parallel_size > 1 else AsyncLLMEngine
    return engine_class(config, max_waiting_requests=args.max_waiting_requests)


def _import_api_server() -> ModuleType:
    # FastAPI and the API's pydantic models (gc_startup). The freeze also takes whatever the engine's build
    # has made by then: harmless here, as `tokenmill serve`'s process builds one engine and keeps it to the end.
    with long_lived_import("fastapi"):
        importlib.import_module("uvicorn")
        return importlib.import_module("tokenmill.entrypoints.openai.api_server")


def serve(args: argparse.Namespace) -> None:
    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    check_output_parsing(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)  # before the model loads
    http = in_background("tokenmill-http-import", _import_api_server)
    engine = make_server_engine(args)
    try:
        api_server = http.result()
    except BaseException:
        asyncio.run(engine.shutdown())
        raise
    api_server.run_server(args, engine)
