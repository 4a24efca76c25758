"""POST /v1/responses: OpenAI's Responses API, text in and text out, over the chat handler.

A request is mapped onto a ChatCompletionRequest (protocol_responses.py) and prepared by
OpenAIServingChat.prepare: the same chat template, sampling parameters, structured output and
length checks as /v1/chat/completions. The engine request runs through the shared stream_outputs
(deadline, metrics, abort when the client leaves); only the response and its events differ.

A stream is the Responses event sequence (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed, or response.incomplete when max_output_tokens cut the answer), each event with
its sequence_number. Events are sent as `data:` lines ending with `data: [DONE]`, the framing of the
server's other streams; OpenAI adds an `event:` line naming each, which clients do not need (they read
the event's `type`, as the `openai` client does) and which the server's SSE checks do not accept.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput

from tokenmill.entrypoints.openai.errors import BadRequest, classify, error_from_exception, request_id_of
from tokenmill.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    response_usage,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import first_output, set_log_usage, stream_outputs
from tokenmill.entrypoints.openai.streaming import DONE, SSEResponse, sse

# The chat request's field names in a 400, as the Responses request calls them.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "structured_outputs": "text",
}


def _in_responses_terms(exc: BaseException) -> BaseException:
    """A 400 about a chat field, renamed to the Responses field it came from (anything else unchanged)."""
    status, _, message, param = classify(exc)
    if status == 400 and param in _PARAMS:
        return BadRequest(message, _PARAMS[param])
    return exc


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: ResponsesRequest, raw: Request | None = None) -> Response:
        try:
            request.check()
            model, prompt, params = await self.chat.prepare(request.to_chat_request())
            base_id = self.chat.base_request_id(raw, "resp")  # resp-<id>: the engine's request ids
            response_id = "resp_" + base_id.split("-", 1)[1]  # OpenAI's ids: resp_..., msg_...
            message_id = f"msg_{uuid.uuid4().hex}"
            created = int(time.time())
            outputs = stream_outputs(self.chat.open([prompt], [params], base_id), self.chat.deadline())
            if request.stream:
                first = await first_output(outputs)
                ids = (response_id, message_id, created)
                return SSEResponse(self._stream(request, model, ids, first[1], outputs, raw))
            final: RequestOutput | None = None
            try:
                async for _, out in outputs:
                    final = out
            finally:
                await outputs.aclose()
        except Exception as exc:
            renamed = _in_responses_terms(exc)
            if renamed is exc:
                raise
            raise renamed from None
        assert final is not None
        choice = final.outputs[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        message = OutputMessage(id=message_id, status=status, content=[OutputText(text=choice.text)])
        usage = response_usage(len(final.prompt_token_ids), len(choice.token_ids))
        response = self._response(request, model, response_id, created, status, message, usage)
        set_log_usage(raw, usage.input_tokens, usage.output_tokens)
        return Response(response.model_dump_json(by_alias=True), media_type="application/json")

    def _response(self, request: ResponsesRequest, model: str, response_id: str, created: int, status: str,
                  message: OutputMessage | None = None, usage: ResponseUsage | None = None,
                  error: ResponseError | None = None) -> ResponsesResponse:
        """The response object, the request's settings echoed as OpenAI does."""
        fmt = request.text.format if request.text is not None else None
        return ResponsesResponse(
            id=response_id,
            created_at=created,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=error,
            instructions=request.instructions,
            model=model,
            output=[message] if message is not None else [],
            parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            tool_choice=request.tool_choice or "auto",
            tools=request.tools or [],
            max_output_tokens=request.max_output_tokens,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            usage=usage,
            user=request.user,
            metadata=request.metadata or {},
        )

    async def _stream(self, request: ResponsesRequest, model: str, ids: tuple[str, str, int], first: RequestOutput,
                      outputs: AsyncIterator, raw: Request | None) -> AsyncIterator[str]:
        response_id, message_id, created = ids
        sequence = itertools.count()
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(sequence), **fields})

        prompt_tokens = len(first.prompt_token_ids)
        generated = 0
        try:
            started = _dump(self._response(request, model, response_id, created, "in_progress"))
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            yield event("response.output_item.added", output_index=0,
                        item=_dump(OutputMessage(id=message_id, status="in_progress")))
            yield event("response.content_part.added", **where, part=_dump(OutputText(text="")))
            last: RequestOutput | None = first
            out: RequestOutput | None = first
            sent = 0
            while out is not None:
                last = out
                choice = out.outputs[0]
                generated = len(choice.token_ids)
                # Text the detokenizer still holds back (a partial character) comes with a later output.
                if len(choice.text) > sent:
                    yield event("response.output_text.delta", **where, delta=choice.text[sent:], logprobs=[])
                    sent = len(choice.text)
                try:
                    _, out = await outputs.__anext__()
                except StopAsyncIteration:
                    out = None
            choice = last.outputs[0]
            status = "incomplete" if choice.finish_reason == "length" else "completed"
            part = OutputText(text=choice.text)
            message = OutputMessage(id=message_id, status=status, content=[part])
            yield event("response.output_text.done", **where, text=choice.text, logprobs=[])
            yield event("response.content_part.done", **where, part=_dump(part))
            yield event("response.output_item.done", output_index=0, item=_dump(message))
            final = self._response(request, model, response_id, created, status, message,
                                   response_usage(prompt_tokens, generated))
            yield event(f"response.{status}", response=_dump(final))
        except Exception as exc:  # after the first byte the status is sent: the error goes in the stream
            body = error_from_exception(exc, request_id_of(raw))["error"]
            yield event("error", code=body["type"], message=body["message"], param=body["param"])
            error = ResponseError(code="server_error" if body["code"] >= 500 else "invalid_prompt", message=body["message"])
            failed = self._response(request, model, response_id, created, "failed",
                                    usage=response_usage(prompt_tokens, generated), error=error)
            yield event("response.failed", response=_dump(failed))
        finally:
            await outputs.aclose()
            set_log_usage(raw, prompt_tokens, generated)
        yield DONE
