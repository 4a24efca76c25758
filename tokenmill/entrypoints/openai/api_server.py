"""The FastAPI app and `tokenmill serve`: OpenAI's routes over an AsyncLLMEngine, run by uvicorn.

build_app(engine, settings) makes the app (tests and embedders can use it directly);
run_server(args) loads the model, then serves until SIGTERM / SIGINT: uvicorn stops taking
connections and lets in-flight requests finish for up to --timeout-graceful-shutdown seconds,
then cancels the rest (which aborts their engine requests), and the engine is shut down.

What one client may ask for is bounded by ServerSettings (each a `tokenmill serve` option): n, prompt
tokens, requests in flight (overall and per API key), and the chat template's render time and size.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

import tokenmill
from tokenmill.errors import TokenmillError
from tokenmill.metrics import CONTENT_TYPE_LATEST, ServerMetrics

from tokenmill.entrypoints.openai.chat_page import ChatPageMiddleware
from tokenmill.entrypoints.openai.chat_output import OutputParsing
from tokenmill.entrypoints.openai.chat_tools import prepare_messages
from tokenmill.entrypoints.openai.chat_utils import check_request_template, normalize_messages, render_chat_async
from tokenmill.entrypoints.openai.template_isolation import TemplateIsolation
from tokenmill.entrypoints.openai.cli_args import (
    DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
)
from tokenmill.entrypoints.openai.errors import (
    BadRequest,
    error_from_exception,
    error_response,
    install_exception_handlers,
    request_id_of,
)
from tokenmill.entrypoints.openai.http_protocol import JSONErrorHttpToolsProtocol
from tokenmill.entrypoints.openai.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    RequestContextMiddleware,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenmill.entrypoints.openai.render_limits import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_MAX_RENDER_SECONDS, RenderLimits
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import ServingLimits
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenmill.entrypoints.openai.streaming import run_until_disconnect

logger = logging.getLogger("tokenmill.server")


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_keys: list[str] = field(default_factory=list)  # empty: the API is open
    request_timeout: float | None = None  # seconds; None: no limit
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    access_log: bool = True
    shutdown_timeout: float = 0.0  # engine.shutdown(timeout) after uvicorn's own graceful wait
    own_engine_thread: bool = True  # False: run_server runs the engine loop on the main thread
    # What one request may ask for (None: no limit)
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    request_body_timeout: float = DEFAULT_BODY_READ_TIMEOUT
    max_prompt_tokens: int | None = None
    max_concurrent_requests: int | None = None
    max_concurrent_requests_per_key: int | None = None  # per API key; per client address without keys
    trust_request_chat_template: bool = False
    max_chat_template_render_seconds: float | None = DEFAULT_MAX_RENDER_SECONDS
    max_chat_template_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS
    # Tool calling and reasoning output (vLLM's flags; names from tool_parsers / reasoning_parsers)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    ui: bool = True  # the chat page at GET / (--no-ui: off)

    def serving_limits(self) -> ServingLimits:
        return ServingLimits(
            max_n=self.max_n,
            max_prompts=self.max_prompts,
            max_prompt_tokens=self.max_prompt_tokens,
            trust_request_chat_template=self.trust_request_chat_template,
            render=RenderLimits(self.max_chat_template_render_seconds, self.max_chat_template_output_chars),
        )

    def output_parsing(self) -> OutputParsing:
        """The tool-call and reasoning parsers (ValueError for an unknown name or a flag without its parser)."""
        return OutputParsing(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)


async def _respond(handler: Awaitable[Response], request_id: str | None) -> Response:
    """Run a route's work; any failure becomes OpenAI error JSON (unexpected ones are logged with their
    traceback under the request id, which their body gives)."""
    try:
        return await handler
    except Exception as exc:  # noqa: BLE001 - every failure answers with error JSON; the server keeps going
        body = error_from_exception(exc, request_id)
        return JSONResponse(body, status_code=body["error"]["code"])


def build_app(engine: Any, settings: ServerSettings | None = None, *, manage_engine: bool = True) -> FastAPI:
    """The app over `engine` (an AsyncLLMEngine, or an AsyncDataParallelEngine). With manage_engine, the app's lifespan starts and shuts it down."""
    settings = settings or ServerSettings()
    names = settings.served_model_names or [engine.model_name]
    models = ServedModels(names, engine.max_model_len, root=engine.model_name)
    metrics = ServerMetrics(names[0], engine.max_model_len, stats=engine.stats,
                            replica_stats=getattr(engine, "replica_stats", None), replica_alive=getattr(engine, "replica_alive", None))
    limits = settings.serving_limits()
    # Request-supplied templates (trusted ones only) render in child processes the OS bounds.
    isolation = (TemplateIsolation(engine.tokenizer, limits.render)
                 if limits.trust_request_chat_template and engine.tokenizer is not None else None)
    common = dict(metrics=metrics, request_timeout=settings.request_timeout, limits=limits, template_isolation=isolation)
    completions = OpenAIServingCompletion(engine, models, **common)
    chat = OpenAIServingChat(engine, models, parsing=settings.output_parsing(), **common)
    responses = OpenAIServingResponses(chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            await engine.start(own_engine_thread=settings.own_engine_thread)
        if isolation is not None:
            await asyncio.to_thread(isolation.wait_ready)
        logger.info("serving %s (max_model_len %d)", ", ".join(names), engine.max_model_len)
        try:
            yield
        finally:
            if isolation is not None:
                isolation.close()
            if manage_engine:
                logger.info("shutting down the engine")
                await engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.models = models
    install_exception_handlers(app)

    # -- OpenAI routes --------------------------------------------------------------
    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await run_until_disconnect(raw, _respond(completions.create(body, raw), request_id_of(raw)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await run_until_disconnect(raw, _respond(chat.create(body, raw), request_id_of(raw)))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await run_until_disconnect(raw, _respond(responses.create(body, raw), request_id_of(raw)))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        # Nothing is stored (store is accepted and ignored), so no response can be retrieved.
        return error_response(404, "this server stores no responses: a response can only be read from the "
                                   "answer to its request", "NotFoundError", "response_id")

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(models.list().model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, raw: Request) -> Response:
        async def work() -> Response:
            return JSONResponse(models.card(models.resolve(model_id)).model_dump())

        return await _respond(work(), request_id_of(raw))

    # -- tokenmill / vLLM extras ----------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if getattr(engine, "errored", False) or not getattr(engine, "is_running", True):
            return error_response(503, "the engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=tokenmill.__version__).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
        async def work() -> Response:
            models.resolve(body.model)
            tokenizer = engine.tokenizer
            if tokenizer is None:
                raise BadRequest("this model was loaded without a tokenizer")
            if (body.prompt is None) == (body.messages is None):
                raise BadRequest("give either prompt or messages", "prompt")
            if body.messages is not None:
                check_request_template(body.chat_template, limits.trust_request_chat_template)
                messages = prepare_messages(normalize_messages(body.messages))
                text = await render_chat_async(
                    tokenizer, messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template=body.chat_template,
                    chat_template_kwargs=body.chat_template_kwargs,
                    tools=body.tools,
                    limits=limits.render,
                    isolation=isolation,
                )
                add_special = bool(body.add_special_tokens)
            else:
                text = body.prompt
                add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await chat.encode(text, add_special)
            strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return JSONResponse(
                TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs).model_dump()
            )

        return await _respond(work(), request_id_of(raw))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> Response:
        async def work() -> Response:
            models.resolve(body.model)
            tokenizer = engine.tokenizer
            if tokenizer is None:
                raise BadRequest("this model was loaded without a tokenizer")
            bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
            if bad:
                raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {engine.vocab_size})", "tokens")
            text = await asyncio.to_thread(tokenizer.decode, body.tokens)
            return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

        return await _respond(work(), request_id_of(raw))

    # Middlewares, innermost first: body limit; requests in flight (counted from arrival, so a slow upload
    # counts too); the API key (checked before a request counts against its key); request ids and access logs.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes, read_timeout=settings.request_body_timeout)
    if settings.max_concurrent_requests is not None or settings.max_concurrent_requests_per_key is not None:
        app.add_middleware(
            ConcurrencyLimitMiddleware,
            max_total=settings.max_concurrent_requests,
            max_per_key=settings.max_concurrent_requests_per_key,
            by_api_key=bool(settings.api_keys),
        )
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, api_keys=settings.api_keys)
    if settings.ui:  # outside the key check: the page loads first, then sends the key typed into it
        app.add_middleware(ChatPageMiddleware)
    app.add_middleware(RequestContextMiddleware, access_log=settings.access_log)
    return app


def default_served_name(args: argparse.Namespace, engine: Any) -> str:
    """vLLM's default: the --model value as given; for the embedded default model its file name."""
    if args.model:
        return args.model
    name = os.path.basename(engine.model_name)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def run_server(args: argparse.Namespace, engine: Any = None) -> None:
    """Serve until SIGTERM / SIGINT; engine: one serve_start.make_server_engine(args) built already, else built here."""
    import uvicorn

    from tokenmill.entrypoints.openai.serve_start import make_server_engine

    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    parsing = dict(tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                   reasoning_parser=args.reasoning_parser)
    OutputParsing(**parsing)  # a bad flag fails before the model loads
    if engine is None:
        # Several replicas: a front end that routes to replica processes (its collector loop takes the main thread).
        engine = make_server_engine(args)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [default_served_name(args, engine)],
        api_keys=list(args.api_key or []),
        request_timeout=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        access_log=not args.disable_access_log,
        shutdown_timeout=1.0,
        own_engine_thread=False,
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        request_body_timeout=args.request_body_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
        max_concurrent_requests_per_key=args.max_concurrent_requests_per_key,
        trust_request_chat_template=args.trust_request_chat_template,
        max_chat_template_render_seconds=args.max_chat_template_render_seconds,
        max_chat_template_output_chars=args.max_chat_template_output_chars,
        **parsing,
        ui=not args.no_ui,
    )
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,  # tokenmill.access logs every request, with its id and token counts
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        timeout_keep_alive=5,
        lifespan="on",
        http=JSONErrorHttpToolsProtocol,  # a request uvicorn cannot parse gets error JSON too
    )
    server = uvicorn.Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"tokenmill: serving {', '.join(settings.served_model_names)} at http://{host}:{args.port}/v1", flush=True)
    # The HTTP side runs on its own thread and the engine loop on the main thread: torch's OpenMP
    # kernels run 1.5-2x slower on a secondary thread here (a whole step: 24 ms against 38 ms).
    # uvicorn installs no signal handlers off the main thread, so SIGTERM / SIGINT are caught here
    # and start its graceful shutdown; the lifespan then shuts the engine down, which ends the loop.
    def handle_exit(sig, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=server.run, name="tokenmill-http")
    try:
        http.start()
        while http.is_alive() and not engine.started.wait(0.1):
            pass
        if engine.started.is_set():
            engine.run_engine_loop()
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise TokenmillError(f"the server could not start on {args.host}:{args.port} (see the log above)")
