"""What the completions and chat handlers share: model names, tokenization off the event loop, the
context-length check, and running engine requests (one per prompt) as one stream of outputs with a
deadline, metrics, and an abort of every engine request when the stream stops early."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from tokenmill.errors import TokenmillError
from tokenmill.metrics import RequestTracker, ServerMetrics
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

from tokenmill.entrypoints.openai.cli_args import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS
from tokenmill.entrypoints.openai.errors import BadRequest, RequestTimeout, ServiceUnavailable, guess_param
from tokenmill.entrypoints.openai.render_limits import RenderLimits
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.template_isolation import TemplateIsolation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingLimits:
    """What the operator lets one request ask for (each a server option; see cli_args.py)."""

    max_n: int = DEFAULT_MAX_N  # n and best_of
    max_prompts: int = DEFAULT_MAX_PROMPTS  # prompts in one completions request
    max_prompt_tokens: int | None = None  # None: only the context length limits a prompt
    trust_request_chat_template: bool = False
    render: RenderLimits = field(default_factory=RenderLimits)


class EngineRequest:
    """One engine request: its outputs one at a time, recorded in the metrics; close() aborts it if unfinished."""

    def __init__(self, engine: Any, prompt: Any, params: SamplingParams, request_id: str, tracker: RequestTracker | None) -> None:
        self.engine = engine
        self.prompt = prompt
        self.params = params
        self.request_id = request_id
        self.tracker = tracker
        self.finished = False
        self.started = False  # an output arrived (the engine took the request)
        self._rejected = False
        self._it: Any = None

    async def next(self) -> RequestOutput:
        if self._it is None:
            self._it = self.engine.generate(self.prompt, self.params, self.request_id).__aiter__()
        try:
            out = await self._it.__anext__()
        except StopAsyncIteration:
            raise ServiceUnavailable("the request ended without a result: the engine is shutting down") from None
        except (TokenmillError, ValueError):
            if not self.started:
                self._rejected = True  # refused up front: not a served request in the metrics
            raise
        self.started = True
        if self.tracker is not None:
            self.tracker.on_output(out)
        if out.finished:
            self.finished = True
            if any(c.finish_reason == "abort" for c in out.outputs):
                raise ServiceUnavailable("the request was aborted: the server is shutting down")
        return out

    async def close(self) -> None:
        if self.tracker is not None and not self.finished and not self._rejected and self.started:
            self.tracker.finish(aborted=True)
        it, self._it = self._it, None
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # the request is gone either way
                logger.debug("closing engine request %s", self.request_id, exc_info=True)
        elif it is not None and not self.finished:
            await self.engine.abort(self.request_id)


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return deadline - asyncio.get_running_loop().time()


async def _until(aw, deadline: float | None):
    """Await aw, or raise RequestTimeout once the deadline has passed (aw is cancelled)."""
    left = _remaining(deadline)
    if left is None:
        return await aw
    try:
        return await asyncio.wait_for(aw, max(left, 0.0))
    except asyncio.TimeoutError:
        raise RequestTimeout("the request took longer than the server's request timeout and was aborted") from None


async def first_output(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
    """A stream's first output, awaited before the response headers go out, so that errors before
    any output (a bad prompt, a full queue) are still plain HTTP errors; on error the stream is closed."""
    try:
        return await outputs.__anext__()
    except BaseException:
        await outputs.aclose()
        raise


async def last_output(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    """A non-streamed request's final output (outputs are cumulative); the stream is closed after."""
    final: RequestOutput | None = None
    try:
        async for _, out in outputs:
            final = out
    finally:
        await outputs.aclose()
    assert final is not None
    return final


async def stream_outputs(requests: list[EngineRequest], deadline: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) as the engine makes them, until every request has finished.

    Several requests are merged: each is pumped by its own task and only its latest output is kept
    (outputs are cumulative), so a slow consumer gets coalesced outputs rather than a growing backlog.
    Leaving early (error, timeout, cancel, aclose) aborts every unfinished engine request.
    """
    try:
        if len(requests) == 1:
            req = requests[0]
            while not req.finished:
                yield 0, await _until(req.next(), deadline)
            return

        latest: dict[int, RequestOutput] = {}
        errors: list[BaseException] = []
        wake = asyncio.Event()

        async def pump(i: int, req: EngineRequest) -> None:
            try:
                while not req.finished:
                    latest[i] = await req.next()
                    wake.set()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                errors.append(exc)
                wake.set()

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        try:
            while True:
                if not latest and not errors:
                    if all(r.finished for r in requests):
                        return
                    await _until(wake.wait(), deadline)
                    wake.clear()
                if errors:
                    raise errors[0]
                items = sorted(latest.items())
                latest.clear()
                for item in items:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for req in requests:
            await req.close()


class OpenAIServing:
    def __init__(self, engine: Any, models: ServedModels, metrics: ServerMetrics | None = None,
                 request_timeout: float | None = None, limits: ServingLimits | None = None,
                 template_isolation: TemplateIsolation | None = None) -> None:
        self.engine = engine
        self.template_isolation = template_isolation  # where request-supplied chat templates render
        self.models = models
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.limits = limits or ServingLimits()
        self._counter = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def base_request_id(self, raw: Request | None, prefix: str) -> str:
        """cmpl-<id> / chatcmpl-<id>: the client's X-Request-Id if it sent one, else a random id."""
        rid = None
        if raw is not None:
            rid = getattr(raw.state, "request_id", None) or raw.headers.get("x-request-id")
        return f"{prefix}-{rid or uuid.uuid4().hex}"

    def engine_request_id(self, base: str, index: int) -> str:
        # Unique even when two clients send the same X-Request-Id.
        return f"{base}-{index}-{next(self._counter)}"

    def deadline(self) -> float | None:
        if not self.request_timeout:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise BadRequest("this model was loaded without a tokenizer: send the prompt as token ids", param)
        return await asyncio.to_thread(lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    def check_fanout(self, n: int | None, best_of: int | None) -> None:
        """n and best_of within --max-n: each sequence costs engine work and output (checked before any)."""
        cap = self.limits.max_n
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > cap:
                raise BadRequest(f"{name} must be at most {cap} on this server (its --max-n), got {value}", name)

    def check_num_prompts(self, count: int) -> None:
        """A completions prompt list within --max-prompts-per-request (checked before any is tokenized)."""
        if count > self.limits.max_prompts:
            raise BadRequest(
                f"prompt holds {count} prompts, more than this server's limit of {self.limits.max_prompts} "
                "(its --max-prompts-per-request)", "prompt"
            )

    def check_length(self, num_prompt_tokens: int, requested: int | None, default: int | None,
                     what: str = "prompt", param: str = "max_tokens") -> int:
        """The max_tokens to run with; a prompt (plus max_tokens) longer than the context is a 400 (vLLM's
        message), and so is a prompt over the server's --max-prompt-tokens."""
        cap = self.limits.max_prompt_tokens
        if cap is not None and num_prompt_tokens > cap:
            raise BadRequest(
                f"the {'rendered chat' if what == 'messages' else 'prompt'} has {num_prompt_tokens} tokens, more than "
                f"this server's limit of {cap} (its --max-prompt-tokens)",
                "messages" if what == "messages" else "prompt",
            )
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input {what}.",
                "messages" if what == "messages" else "prompt",
            )
        room = limit - num_prompt_tokens
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested + num_prompt_tokens} tokens ({num_prompt_tokens} in the {what}, {requested} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param,
            )
        return requested

    @staticmethod
    def sampling_params(build, renames: dict[str, str] | None = None) -> SamplingParams:
        """Build SamplingParams; a bad value is a 400 naming the request's own field."""
        try:
            return build()
        except (TypeError, ValueError) as exc:
            if isinstance(exc, BadRequest):
                raise
            message = str(exc)
            param = guess_param(message)
            if renames and param in renames:
                message = renames[param] + message[len(param):]
                param = renames[param]
            raise BadRequest(message, param) from None

    def open(self, prompts: list[Any], params: list[SamplingParams], base_id: str) -> list[EngineRequest]:
        return [
            EngineRequest(self.engine, p, sp, self.engine_request_id(base_id, i), self.metrics.track() if self.metrics else None)
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]


def set_log_usage(raw: Request | None, prompt_tokens: int, completion_tokens: int) -> None:
    """Token counts for the request's access-log line."""
    if raw is not None:
        raw.state.prompt_tokens = prompt_tokens
        raw.state.completion_tokens = completion_tokens
