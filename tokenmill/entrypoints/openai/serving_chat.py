"""POST /v1/chat/completions: the chat template applied off the event loop, one engine request with n choices."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput

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
    usage,
)
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, first_output, set_log_usage, stream_outputs
from tokenmill.entrypoints.openai.streaming import DONE, SSEResponse, sse

logger = logging.getLogger(__name__)

# SamplingParams' names for what the chat request calls otherwise (for the `param` of a 400).
_RENAMES = {"logprobs": "top_logprobs"}


class OpenAIServingChat(OpenAIServing):
    async def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text from the chat template and its token ids (blocking work in a thread)."""
        check_request_template(request.chat_template, self.limits.trust_request_chat_template)
        messages = normalize_messages(request.messages)
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
        )
        # The template already holds the special tokens (BOS and the like): don't add them twice.
        return text, await self.encode(text, request.add_special_tokens, "messages")

    async def create(self, request: ChatCompletionRequest, raw: Request | None = None) -> Response:
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
        params = self.sampling_params(lambda: request.to_sampling_params(max_tokens), renames)

        base_id = self.base_request_id(raw, "chatcmpl")
        reqs = self.open([prompt], [params], base_id)
        outputs = stream_outputs(reqs, self.deadline())
        texts = TokenTexts(self.tokenizer, bool(request.return_tokens_as_token_ids))
        if request.stream:
            first = await first_output(outputs)
            return SSEResponse(self._stream(request, model, base_id, first[1], outputs, texts, raw))
        final: RequestOutput | None = None
        try:
            async for _, out in outputs:
                final = out
        finally:
            await outputs.aclose()
        assert final is not None
        response = self._response(request, model, base_id, final, texts)
        set_log_usage(raw, response.usage.prompt_tokens, response.usage.completion_tokens or 0)
        return Response(response.model_dump_json(), media_type="application/json")

    def _response(self, request: ChatCompletionRequest, model: str, base_id: str, out: RequestOutput,
                  texts: TokenTexts) -> ChatCompletionResponse:
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], request.top_logprobs or 0, texts)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatMessage(role="assistant", content=c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
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
                      outputs: AsyncIterator, texts: TokenTexts, raw: Request | None) -> AsyncIterator[str]:
        n = request.n or 1
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
                        yield chunk(c.index, {"content": delta}, logprobs, completion_tokens=len(c.token_ids))
                    if c.finish_reason is not None:
                        done.add(c.index)
                        yield chunk(c.index, {}, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    completion_tokens=len(c.token_ids))
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
