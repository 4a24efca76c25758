"""POST /v1/completions: one engine request per prompt (each with n choices, indexed prompt * n + choice)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import CompletionOutput, RequestOutput

from tokenmill.entrypoints.openai.errors import BadRequest, error_from_exception, request_id_of
from tokenmill.entrypoints.openai.logprobs import TokenTexts, completion_logprobs, prompt_logprobs_json
from tokenmill.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    usage,
)
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing, first_output, set_log_usage, stream_outputs
from tokenmill.entrypoints.openai.streaming import DONE, SSEResponse, sse

logger = logging.getLogger(__name__)


class _Prompt:
    def __init__(self, text: str | None, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request | None = None) -> Response:
        request.check()
        self.check_fanout(request.n, request.best_of)
        model = self.models.resolve(request.model)
        prompts: list[_Prompt] = []
        all_prompts = request.prompts()
        self.check_num_prompts(len(all_prompts))
        for i, p in enumerate(all_prompts):
            if isinstance(p, str):
                ids = await self.encode(p, request.add_special_tokens)
                text: str | None = p
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                ids, text = list(p), None
                bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
                if bad:
                    raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.engine.vocab_size})", "prompt")
            else:
                raise BadRequest("prompt must be a string, a list of strings, token ids or a list of token id lists", "prompt")
            if request.truncate_prompt_tokens is not None and len(ids) > request.truncate_prompt_tokens:
                ids, text = ids[-request.truncate_prompt_tokens :], None
            if not ids:
                raise BadRequest(f"prompt {i} is empty" if len(all_prompts) > 1 else "the prompt is empty", "prompt")
            prompts.append(_Prompt(text, ids))

        explicit = "max_tokens" in request.model_fields_set
        params = []
        for p in prompts:
            # max_tokens: OpenAI's default 16 (kept within the context); an explicit null means up to the context.
            max_tokens = self.check_length(len(p.token_ids), request.max_tokens, None if explicit else 16)
            params.append(self.sampling_params(lambda: request.to_sampling_params(max_tokens)))

        base_id = self.base_request_id(raw, "cmpl")
        engine_prompts: list[Any] = [
            {"prompt": p.text, "prompt_token_ids": p.token_ids} if p.text is not None else {"prompt_token_ids": p.token_ids}
            for p in prompts
        ]
        reqs = self.open(engine_prompts, params, base_id)
        outputs = stream_outputs(reqs, self.deadline())
        texts = TokenTexts(self.tokenizer, bool(request.return_tokens_as_token_ids))
        if request.stream:
            first = await first_output(outputs)
            return SSEResponse(self._stream(request, model, base_id, prompts, first, outputs, texts, raw))
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in outputs:
                finals[i] = out
        finally:
            await outputs.aclose()
        response = self._response(request, model, base_id, prompts, finals, texts)
        set_log_usage(raw, response.usage.prompt_tokens, response.usage.completion_tokens or 0)
        return Response(response.model_dump_json(), media_type="application/json")

    # -- helpers ------------------------------------------------------------------
    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        return self.tokenizer.decode(p.token_ids) if self.tokenizer is not None else ""

    def _response(self, request: CompletionRequest, model: str, base_id: str, prompts: list[_Prompt],
                  finals: list[RequestOutput | None], texts: TokenTexts) -> CompletionResponse:
        n = request.n or 1
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, (p, out) in enumerate(zip(prompts, finals)):
            assert out is not None
            prompt_tokens += len(out.prompt_token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                text = c.text
                logprobs = None
                if request.echo:
                    text = self._prompt_text(p) + text
                if request.logprobs is not None:
                    token_ids, steps = list(c.token_ids), list(c.logprobs or [])
                    if request.echo:
                        token_ids = list(out.prompt_token_ids) + token_ids
                        steps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + steps
                    logprobs = completion_logprobs(token_ids, steps, request.logprobs, texts)
                choices.append(
                    CompletionResponseChoice(
                        index=i * n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if request.prompt_logprobs is not None else None,
                    )
                )
        return CompletionResponse(id=base_id, model=model, choices=choices, usage=usage(prompt_tokens, completion_tokens))

    async def _stream(self, request: CompletionRequest, model: str, base_id: str, prompts: list[_Prompt],
                      first: tuple[int, RequestOutput], outputs: AsyncIterator[tuple[int, RequestOutput]],
                      texts: TokenTexts, raw: Request | None) -> AsyncIterator[str]:
        n = request.n or 1
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                i, out = item
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    index = i * n + c.index
                    if index in done:
                        continue
                    chunk = self._chunk(request, model, base_id, created, prompts[i], out, c, index, sent_text, sent_tokens, texts)
                    completion_tokens[index] = len(c.token_ids)
                    if chunk is None:
                        continue
                    if c.finish_reason is not None:
                        done.add(index)
                    if continuous:
                        chunk.usage = usage(prompt_tokens[i], len(c.token_ids))
                    yield sse(chunk)
                item = await outputs.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as exc:  # after the first byte the status is sent: the error goes in the stream
            yield sse(error_from_exception(exc, request_id_of(raw)))
            yield DONE
            return
        finally:
            await outputs.aclose()
            set_log_usage(raw, sum(prompt_tokens.values()), sum(completion_tokens.values()))
        if include_usage:
            final = CompletionStreamResponse(
                id=base_id, created=created, model=model, choices=[],
                usage=usage(sum(prompt_tokens.values()), sum(completion_tokens.values())),
            )
            yield sse(final)
        yield DONE

    def _chunk(self, request: CompletionRequest, model: str, base_id: str, created: int, prompt: _Prompt, out: RequestOutput,
               c: CompletionOutput, index: int, sent_text: dict[int, int], sent_tokens: dict[int, int],
               texts: TokenTexts) -> CompletionStreamResponse | None:
        """The chunk carrying what choice `index` got since the last one (None: nothing new)."""
        first = index not in sent_text
        text_from = sent_text.get(index, 0)
        tokens_from = sent_tokens.get(index, 0)
        delta = c.text[text_from:]
        new_ids = list(c.token_ids[tokens_from:])
        # Tokens whose text the detokenizer still holds back wait for the next chunk (unless logprobs are
        # asked for: those go out with their tokens).
        if not delta and not (new_ids and request.logprobs is not None) and c.finish_reason is None and not (first and request.echo):
            return None
        sent_text[index] = len(c.text)
        sent_tokens[index] = len(c.token_ids)
        prefix_ids: list[int] = []
        prefix_steps: list = []
        if first and request.echo:
            delta = self._prompt_text(prompt) + delta
            prefix_ids = list(out.prompt_token_ids)
            prefix_steps = list(out.prompt_logprobs or [None] * len(prefix_ids))
        logprobs = None
        if request.logprobs is not None:
            steps = list((c.logprobs or [])[tokens_from : tokens_from + len(new_ids)])
            offset = 0 if first else text_from + (len(self._prompt_text(prompt)) if request.echo else 0)
            logprobs = completion_logprobs(prefix_ids + new_ids, prefix_steps + steps, request.logprobs, texts, offset)
        return CompletionStreamResponse(
            id=base_id,
            created=created,
            model=model,
            choices=[CompletionStreamChoice(index=index, text=delta, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
        )
