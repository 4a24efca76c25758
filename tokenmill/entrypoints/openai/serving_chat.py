"""POST /v1/chat/completions: the chat template applied off the event loop, one engine request with n choices.

Tool calling and reasoning (chat_output.py): tool_choice "required" or a named function is forced
with structured output (the tools' schemas, chat_tools.py); "auto" reads the model's own call
format with the server's --tool-call-parser; --reasoning-parser splits off reasoning_content, and
then an output constraint applies to the answer only (reasoning_grammar.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

from tokenmill.entrypoints.openai.chat_output import ChoiceParser, MessageDelta, OutputParsing
from tokenmill.entrypoints.openai.chat_tools import forced_tool_schema, prepare_messages
from tokenmill.entrypoints.openai.chat_utils import check_request_template, normalize_messages, render_chat_async
from tokenmill.entrypoints.openai.errors import BadRequest, error_from_exception, request_id_of
from tokenmill.entrypoints.openai.logprobs import TokenTexts, chat_logprobs, prompt_logprobs_json
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    usage,
)
from tokenmill.entrypoints.openai.reasoning_grammar import constrain_answer
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, first_output, last_output, set_log_usage, stream_outputs
from tokenmill.entrypoints.openai.streaming import DONE, SSEResponse, sse

logger = logging.getLogger(__name__)

# SamplingParams' names for what the chat request calls otherwise (for the `param` of a 400).
_RENAMES = {"logprobs": "top_logprobs"}


def _delta_dicts(d: MessageDelta) -> list[dict]:
    """A choice's new output as stream deltas: reasoning, content, then each tool call piece on its own
    (a call's first piece has its id, type and name, as OpenAI streams them)."""
    out: list[dict] = []
    if d.reasoning_content:
        out.append({"reasoning_content": d.reasoning_content})
    if d.content:
        out.append({"content": d.content})
    for call in d.tool_calls:
        if call.name is not None:
            piece = DeltaToolCall(index=call.index, id=call.id, type="function",
                                  function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
        else:
            piece = DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))
        out.append({"tool_calls": [piece.model_dump(exclude_none=True)]})
    return out


def _finish_reason(reason: str | None, tools_called: bool) -> str | None:
    # A call that ended normally is reported as OpenAI does; a cut-off one keeps "length".
    return "tool_calls" if tools_called and reason == "stop" else reason


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, parsing: OutputParsing | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parsing = parsing or OutputParsing()

    async def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text from the chat template and its token ids (blocking work in a thread)."""
        check_request_template(request.chat_template, self.limits.trust_request_chat_template)
        messages = prepare_messages(normalize_messages(request.messages))
        text = await render_chat_async(
            self.tokenizer,
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
            documents=request.documents,
            limits=self.limits.render,
            isolation=self.template_isolation,
        )
        # The template already holds the special tokens (BOS and the like): don't add them twice.
        return text, await self.encode(text, request.add_special_tokens, "messages")

    async def prepare(self, request: ChatCompletionRequest) -> tuple[str, dict, SamplingParams]:
        """The checked request as (model name, engine prompt, SamplingParams); shared with the Responses API,
        whose requests are mapped onto a ChatCompletionRequest (serving_responses.py)."""
        request.check()
        self.check_fanout(request.n, request.best_of)
        model = self.models.resolve(request.model)
        text, ids = await self.render(request)
        prompt: dict = {"prompt": text, "prompt_token_ids": ids}
        if request.truncate_prompt_tokens is not None and len(ids) > request.truncate_prompt_tokens:
            prompt = {"prompt_token_ids": ids[-request.truncate_prompt_tokens :]}
        if not prompt["prompt_token_ids"]:
            raise BadRequest("the chat template produced an empty prompt", "messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.check_length(len(prompt["prompt_token_ids"]), request.requested_max_tokens, None, "messages", param)
        renames = dict(_RENAMES, max_tokens=param)
        overrides = await self._output_overrides(request)
        params = self.sampling_params(lambda: request.to_sampling_params(max_tokens, **overrides), renames)
        return model, prompt, params

    async def _output_overrides(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """SamplingParams fields that tools and reasoning set: the output constraint (the tools' schema
        for a forced call; any constraint only after the reasoning) and skip_special_tokens."""
        choice = request.resolved_tool_choice()
        self.parsing.check_tool_choice(choice)
        constraint = request.structured_outputs_params()
        param = "response_format" if request.response_format is not None else "structured_outputs"
        schema = forced_tool_schema(request.tools or [], choice, request.parallel_tool_calls)
        if schema is not None:
            if constraint is not None:
                raise BadRequest(
                    f"tool_choice {choice.mode if choice.mode != 'named' else 'naming a function'} forces the output "
                    f"with structured output, which cannot be combined with {param}", "tool_choice",
                )
            # One space after "," and ":" (json.dumps' style, the one models learn): compact arguments, and
            # no runaway whitespace from small models.
            constraint, param = StructuredOutputsParams(json=schema, disable_any_whitespace=True), "tools"
        overrides: dict[str, Any] = {}
        reasoning = self.parsing.reasoning_class
        if constraint is not None and reasoning is not None:
            constraint = await constrain_answer(reasoning, constraint, param)
        if constraint is not None:
            overrides["structured_outputs"] = constraint
        if self.parsing.keeps_special_tokens(choice):
            overrides["skip_special_tokens"] = False
        return overrides

    def choice_parsers(self, request: ChatCompletionRequest) -> Callable[[], ChoiceParser] | None:
        """A factory of per-choice output parsers for the request, or None when its output is plain content."""
        return self.parsing.for_request(request.resolved_tool_choice(), request.parallel_tool_calls, self.tokenizer)

    async def create(self, request: ChatCompletionRequest, raw: Request | None = None) -> Response:
        model, prompt, params = await self.prepare(request)
        base_id = self.base_request_id(raw, "chatcmpl")
        reqs = self.open([prompt], [params], base_id)
        outputs = stream_outputs(reqs, self.deadline())
        texts = TokenTexts(self.tokenizer, bool(request.return_tokens_as_token_ids))
        parsers = self.choice_parsers(request)
        if request.stream:
            first = await first_output(outputs)
            return SSEResponse(self._stream(request, model, base_id, first[1], outputs, texts, raw, parsers))
        final = await last_output(outputs)
        response = self._response(request, model, base_id, final, texts, parsers)
        set_log_usage(raw, response.usage.prompt_tokens, response.usage.completion_tokens or 0)
        return Response(response.model_dump_json(), media_type="application/json")

    def _response(self, request: ChatCompletionRequest, model: str, base_id: str, out: RequestOutput,
                  texts: TokenTexts, parsers: Callable[[], ChoiceParser] | None = None) -> ChatCompletionResponse:
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], request.top_logprobs or 0, texts)
            message = ChatMessage(role="assistant", content=c.text)
            if parsers is not None:
                parts = parsers().whole(c.text)
                calls = [ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in parts.tool_calls]
                message = ChatMessage(role="assistant", content=parts.content, reasoning_content=parts.reasoning_content,
                                      tool_calls=calls)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(c.finish_reason, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=base_id,
            model=model,
            choices=choices,
            usage=usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)),
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )

    async def _stream(self, request: ChatCompletionRequest, model: str, base_id: str, first: RequestOutput,
                      outputs: AsyncIterator, texts: TokenTexts, raw: Request | None,
                      parsers: Callable[[], ChoiceParser] | None = None) -> AsyncIterator[str]:
        n = request.n or 1
        # Each choice's parsers (reasoning, tool calls) hold back what they cannot place yet.
        choice_parsers: dict[int, ChoiceParser] = {i: parsers() for i in range(n)} if parsers is not None else {}
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_tokens = len(first.prompt_token_ids)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        generated: dict[int, int] = {}
        done: set[int] = set()

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None, completion_tokens=0) -> str:
            return sse(ChatCompletionStreamResponse(
                id=base_id, created=created, model=model,
                choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                          finish_reason=finish_reason, stop_reason=stop_reason)],
                usage=usage(prompt_tokens, completion_tokens) if continuous else None,
            ))

        try:
            for index in range(n):  # the role comes first, in a delta of its own (as OpenAI sends it)
                yield chunk(index, {"role": "assistant", "content": ""})
            out: RequestOutput | None = first
            while out is not None:
                for c in out.outputs:
                    if c.index in done:
                        continue
                    text_from = sent_text.get(c.index, 0)
                    tokens_from = sent_tokens.get(c.index, 0)
                    delta = c.text[text_from:]
                    new_ids = list(c.token_ids[tokens_from:])
                    generated[c.index] = len(c.token_ids)
                    # Tokens whose text the detokenizer still holds back wait for the next chunk
                    # (unless logprobs are asked for: those go out with their tokens).
                    if delta or (new_ids and request.logprobs):
                        sent_text[c.index] = len(c.text)
                        sent_tokens[c.index] = len(c.token_ids)
                        logprobs = None
                        if request.logprobs:
                            steps = (c.logprobs or [])[tokens_from : tokens_from + len(new_ids)]
                            logprobs = chat_logprobs(new_ids, steps, request.top_logprobs or 0, texts)
                        parser = choice_parsers.get(c.index)
                        if parser is None:
                            yield chunk(c.index, {"content": delta}, logprobs, completion_tokens=len(c.token_ids))
                        else:
                            pieces = _delta_dicts(parser.delta(delta)) if delta else []
                            if logprobs is not None and not pieces:
                                pieces = [{}]  # the tokens' logprobs go out even while their text is held back
                            for piece in pieces:
                                yield chunk(c.index, piece, logprobs, completion_tokens=len(c.token_ids))
                                logprobs = None
                    if c.finish_reason is not None:
                        done.add(c.index)
                        parser = choice_parsers.get(c.index)
                        tools_called = False
                        if parser is not None:
                            for piece in _delta_dicts(parser.finish()):
                                yield chunk(c.index, piece, completion_tokens=len(c.token_ids))
                            tools_called = parser.tools_called
                        yield chunk(c.index, {}, finish_reason=_finish_reason(c.finish_reason, tools_called),
                                    stop_reason=c.stop_reason, completion_tokens=len(c.token_ids))
                try:
                    _, out = await outputs.__anext__()
                except StopAsyncIteration:
                    out = None
        except Exception as exc:  # after the first byte the status is sent: the error goes in the stream
            yield sse(error_from_exception(exc, request_id_of(raw)))
            yield DONE
            return
        finally:
            await outputs.aclose()
            set_log_usage(raw, prompt_tokens, sum(generated.values()))
        if include_usage:
            yield sse(ChatCompletionStreamResponse(
                id=base_id, created=created, model=model, choices=[],
                usage=usage(prompt_tokens, sum(generated.values())),
            ))
        yield DONE
