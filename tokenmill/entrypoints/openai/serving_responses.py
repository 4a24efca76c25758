"""POST /v1/responses: OpenAI's Responses API over the chat handler: text, function calls, reasoning.

A request is mapped onto a ChatCompletionRequest (protocol_responses.py) and prepared by
OpenAIServingChat.prepare: the same chat template, sampling parameters, structured output, tool
choice (a forced call's schema; "auto" needs --enable-auto-tool-choice and --tool-call-parser) and
length checks as /v1/chat/completions. The engine request runs through the shared stream_outputs
(deadline, metrics, abort when the client leaves), and its text through chat's own output parsers
(chat_output.py): reasoning, the answer and function calls become the output items, in that order,
a reasoning item, a message, function_call items (OutputBuilder).

A stream is the Responses event sequence: response.created, response.in_progress, then for each
output item response.output_item.added, its content events (response.content_part.added,
response.reasoning_text.delta... / .done or response.output_text.delta... / .done,
response.content_part.done; for a function call response.function_call_arguments.delta... / .done),
response.output_item.done; then response.completed, or response.incomplete when max_output_tokens
cut the output; each event with its sequence_number. The framing is OpenAI's (and vLLM's): each
event is an `event: <type>` line and a `data: <json>` line, and the stream ends with its last
event, without the `data: [DONE]` of the chat and completions streams (the `openai` client stops at
[DONE] if one comes, and otherwise at the end of the body).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput

from tokenmill.entrypoints.openai.chat_output import ChoiceParser, MessageDelta
from tokenmill.entrypoints.openai.errors import BadRequest, classify, error_body, error_from_exception, request_id_of
from tokenmill.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    response_usage,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import first_output, last_output, set_log_usage, stream_outputs
from tokenmill.entrypoints.openai.streaming import SSEResponse
from tokenmill.entrypoints.openai.tool_parsers import ToolCall

logger = logging.getLogger(__name__)

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
    if status == 400 and (param in _PARAMS or "response_format" in message):
        # e.g. a forced tool choice "cannot be combined with response_format": text.format here
        return BadRequest(message.replace("response_format", "text.format"), _PARAMS.get(param, param))
    return exc


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's prefixes: rs_ (reasoning), msg_, fc_ (function call)


def sse_event(kind: str, payload: dict[str, Any]) -> str:
    """One named event in OpenAI's framing: the event's type on an `event:` line, then its JSON."""
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class OutputBuilder:
    """The output items of one response, built from the pieces of its text as they come (reasoning, answer,
    function calls), and, when `event` is given, the stream events that build the same items in a client
    (collected in `events`, which the stream drains). An item is closed when the next one opens, or at
    finish(); an output with no item at all is an empty message."""

    def __init__(self, event: Callable[..., str] | None = None) -> None:
        self.items: list[OutputItem] = []
        self.events: list[str] = []
        self._event = event
        self._open: OutputItem | None = None  # the last item, while it still grows
        self._text = ""  # the open item's text: reasoning, answer or arguments
        self._call_index: int | None = None  # the open function call's index in the parser's calls

    def add(self, delta: MessageDelta) -> None:
        """A parsed piece of the output (reasoning comes first, then the answer, then the calls)."""
        if delta.reasoning_content:
            self.reasoning(delta.reasoning_content)
        if delta.content:
            self.text(delta.content)
        for call in delta.tool_calls:
            if call.name is not None:
                self.call(call.index, call.id or "", call.name)
            if call.arguments:
                self.arguments(call.index, call.arguments)

    def whole(self, reasoning: str | None, content: str | None, calls: list[ToolCall]) -> None:
        """A whole parsed output (a response that is not streamed)."""
        if reasoning:
            self.reasoning(reasoning)
        if content:
            self.text(content)
        for index, call in enumerate(calls):
            self.call(index, call.id, call.name)
            self.arguments(index, call.arguments)

    def reasoning(self, delta: str) -> None:
        if not isinstance(self._open, ReasoningItem):
            self._start(ReasoningItem(id=_item_id("rs"), status="in_progress"))
            self._emit("response.content_part.added", **self._at(), content_index=0, part=_dump(ReasoningText(text="")))
        self._text += delta
        self._emit("response.reasoning_text.delta", **self._at(), content_index=0, delta=delta)

    def text(self, delta: str) -> None:
        if not isinstance(self._open, OutputMessage):
            self._start_message()
        self._text += delta
        self._emit("response.output_text.delta", **self._at(), content_index=0, delta=delta, logprobs=[])

    def call(self, index: int, call_id: str, name: str) -> None:
        self._start(FunctionCallItem(id=_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress"))
        self._call_index = index

    def arguments(self, index: int, delta: str) -> None:
        # The parsers show the calls in order, each one whole before the next one is named, so a
        # fragment belongs to the open call; anything else would be a parser's bug, logged and dropped.
        if not isinstance(self._open, FunctionCallItem) or index != self._call_index:
            logger.warning("dropped arguments of tool call %d, which is not the open output item", index)
            return
        self._text += delta
        self._emit("response.function_call_arguments.delta", **self._at(), delta=delta)

    def finish(self, status: str) -> list[OutputItem]:
        """Close the last item with the response's status ("incomplete": cut by max_output_tokens)."""
        if not self.items:
            self._start_message()
        self._close(status)
        return self.items

    # -- items and their events --------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self._event is not None:
            self.events.append(self._event(kind, **fields))

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1}

    def _start(self, item: OutputItem) -> None:
        self._close("completed")  # the item before it is whole
        self.items.append(item)
        self._open, self._text, self._call_index = item, "", None
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_dump(item))

    def _start_message(self) -> None:
        self._start(OutputMessage(id=_item_id("msg"), status="in_progress"))
        self._emit("response.content_part.added", **self._at(), content_index=0, part=_dump(OutputText(text="")))

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        at, text = self._at(), self._text
        if isinstance(item, ReasoningItem):
            part = ReasoningText(text=text)
            done: OutputItem = item.model_copy(update={"content": [part], "status": status})
            self._emit("response.reasoning_text.done", **at, content_index=0, text=text)
            self._emit("response.content_part.done", **at, content_index=0, part=_dump(part))
        elif isinstance(item, OutputMessage):
            part = OutputText(text=text)
            done = item.model_copy(update={"content": [part], "status": status})
            self._emit("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            self._emit("response.content_part.done", **at, content_index=0, part=_dump(part))
        else:
            done = item.model_copy(update={"arguments": text, "status": status})
            self._emit("response.function_call_arguments.done", **at, arguments=text)
        self.items[-1] = done
        self._open = None
        self._emit("response.output_item.done", output_index=at["output_index"], item=_dump(done))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: ResponsesRequest, raw: Request | None = None) -> Response:
        try:
            request.check()
            chat_request = request.to_chat_request()
            model, prompt, params = await self.chat.prepare(chat_request)
            parsers = self.chat.choice_parsers(chat_request)
            base_id = self.chat.base_request_id(raw, "resp")  # resp-<id>: the engine's request ids
            response_id = "resp_" + base_id.split("-", 1)[1]  # OpenAI's ids: resp_..., msg_...
            created = int(time.time())
            outputs = stream_outputs(self.chat.open([prompt], [params], base_id), self.chat.deadline())
            if request.stream:
                first = await first_output(outputs)
                stream = _EventStream(self, request, model, response_id, created, parsers)
                return _ResponsesSSE(stream.run(first[1], outputs, raw), stream)
            final = await last_output(outputs)
        except Exception as exc:
            renamed = _in_responses_terms(exc)
            if renamed is exc:
                raise
            raise renamed from None
        choice = final.outputs[0]
        builder = OutputBuilder()
        if parsers is None:
            builder.whole(None, choice.text, [])
        else:
            parts = parsers().whole(choice.text)
            builder.whole(parts.reasoning_content, parts.content, parts.tool_calls)
        status = _status(choice.finish_reason)
        usage = response_usage(len(final.prompt_token_ids), len(choice.token_ids))
        response = self.response(request, model, response_id, created, status, builder.finish(status), usage)
        set_log_usage(raw, usage.input_tokens, usage.output_tokens)
        return Response(response.model_dump_json(by_alias=True), media_type="application/json")

    def response(self, request: ResponsesRequest, model: str, response_id: str, created: int, status: str,
                 output: list[OutputItem] | None = None, usage: ResponseUsage | None = None,
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
            output=output or [],
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


class _EventStream:
    """One streamed response: its events, numbered in order, from the engine's outputs to the last event."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, model: str, response_id: str,
                 created: int, parsers: Callable[[], ChoiceParser] | None) -> None:
        self.serving = serving
        self.request = request
        self.model = model
        self.response_id = response_id
        self.created = created
        self.parser = parsers() if parsers is not None else None
        self.sequence = itertools.count()
        self.builder = OutputBuilder(self.event)
        self.prompt_tokens = 0
        self.generated = 0
        self.ended = False  # the last event has gone out

    def event(self, kind: str, **fields: Any) -> str:
        return sse_event(kind, {"type": kind, "sequence_number": next(self.sequence), **fields})

    def _response(self, status: str, output: list[OutputItem] | None = None, usage: ResponseUsage | None = None,
                  error: ResponseError | None = None) -> dict[str, Any]:
        return _dump(self.serving.response(self.request, self.model, self.response_id, self.created, status, output,
                                           usage, error))

    def _drain(self) -> list[str]:
        events, self.builder.events = self.builder.events, []
        return events

    async def run(self, first: RequestOutput, outputs: AsyncIterator, raw: Request | None) -> AsyncIterator[str]:
        self.prompt_tokens = len(first.prompt_token_ids)
        try:
            started = self._response("in_progress")
            yield self.event("response.created", response=started)
            yield self.event("response.in_progress", response=started)
            last: RequestOutput = first
            out: RequestOutput | None = first
            sent = 0
            while out is not None:
                last = out
                choice = out.outputs[0]
                self.generated = len(choice.token_ids)
                # Text the detokenizer still holds back (a partial character) comes with a later output.
                if len(choice.text) > sent:
                    piece = choice.text[sent:]
                    sent = len(choice.text)
                    if self.parser is None:
                        self.builder.text(piece)
                    else:
                        self.builder.add(self.parser.delta(piece))
                    for e in self._drain():
                        yield e
                try:
                    _, out = await outputs.__anext__()
                except StopAsyncIteration:
                    out = None
            if self.parser is not None:
                self.builder.add(self.parser.finish())  # what the parsers held back
            status = _status(last.outputs[0].finish_reason)
            items = self.builder.finish(status)
            for e in self._drain():
                yield e
            final = self._response(status, items, response_usage(self.prompt_tokens, self.generated))
            yield self.event(f"response.{status}", response=final)
            self.ended = True
        except Exception as exc:  # after the first byte the status is sent: the error goes in the stream
            for e in self.failed(error_from_exception(exc, request_id_of(raw))["error"]):
                yield e
        finally:
            await outputs.aclose()
            set_log_usage(raw, self.prompt_tokens, self.generated)

    def failed(self, body: dict[str, Any]) -> list[str]:
        """An error event, then response.failed: how a Responses stream ends after a failure."""
        self.ended = True
        error = ResponseError(code="server_error" if body["code"] >= 500 else "invalid_prompt", message=body["message"])
        failed = self._response("failed", usage=response_usage(self.prompt_tokens, self.generated), error=error)
        return [self.event("error", code=body["type"], message=body["message"], param=body["param"]),
                self.event("response.failed", response=failed)]


class _ResponsesSSE(SSEResponse):
    """A Responses stream, which the server's shutdown ends with an error event and response.failed."""

    def __init__(self, content: AsyncIterator[str], stream: _EventStream) -> None:
        super().__init__(content)
        self.stream = stream

    def shutdown_tail(self, message: str) -> str:
        return "" if self.stream.ended else "".join(self.stream.failed(error_body(503, message)["error"]))
