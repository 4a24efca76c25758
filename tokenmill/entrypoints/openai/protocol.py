"""The OpenAI API's request and response shapes as pydantic models, with vLLM's extra sampling fields.

Unknown request fields are accepted and ignored with a warning (as vLLM does); a known field with an
invalid value is a 400 that names the field. Every request body is first walked once as parsed JSON
(body_checks.py): text that is not valid Unicode, nesting too deep, or integers beyond 64 bits are a
400. `to_sampling_params` turns a request into tokenmill.SamplingParams (OpenAI names and vLLM names
alike).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

from tokenmill.entrypoints.openai.body_checks import find_body_problem
from tokenmill.entrypoints.openai.chat_tools import ToolChoice, check_tools, resolve_tool_choice
from tokenmill.entrypoints.openai.errors import INVALID_BODY, BadRequest

logger = logging.getLogger(__name__)

# JSON has no -inf: a logprob of -inf is reported as this (vLLM's choice).
MIN_LOGPROB = -9999.0


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept out of the way and logged, not refused (clients send newer fields).
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="wrap")
    @classmethod
    def _warn_unknown_fields(cls, data: Any, handler):
        result = handler(data)
        extra = getattr(result, "model_extra", None)
        if extra:
            # repr(): a client's field name must never start a log line of its own (newlines).
            logger.warning("%s: ignoring unknown fields %s", cls.__name__, ", ".join(repr(k)[:80] for k in sorted(extra)))
        return result


# ---------------------------------------------------------------- requests


class RequestBody(OpenAIBaseModel):
    """A request body: checked as a whole before its fields are (once: nested models don't repeat it)."""

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        problem = find_body_problem(data)
        if problem is not None:
            # A custom error type, so that the server's 400 keeps this message and names the field.
            raise PydanticCustomError(INVALID_BODY, "{message}", {"message": problem.message, "param": problem.param})
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(RequestBody):
    """Fields completions and chat share: OpenAI's sampling parameters and vLLM's extras."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names of structured_outputs
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    request_id: str | None = None
    priority: int = 0

    def check_common(self) -> None:
        if self.use_beam_search:
            raise BadRequest("use_beam_search is not supported by the server; use LLM.beam_search offline", "use_beam_search")
        if self.logits_processors:
            raise BadRequest("logits_processors are not supported", "logits_processors")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be given when stream is true", "stream_options")
        if self.stream and self.best_of is not None and self.best_of != (self.n or 1):
            raise BadRequest("best_of other than n is not supported with stream=true", "best_of")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, under any of its names (None: unconstrained)."""
        given: list[tuple[str, dict]] = []
        if self.structured_outputs:
            known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
            fields = {k: v for k, v in self.structured_outputs.items() if k in known and v is not None}
            ignored = sorted(set(self.structured_outputs) - known)
            if ignored:
                logger.warning("structured_outputs: ignoring unsupported fields %s", ", ".join(ignored))
            given.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, {key: value}))
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.json_schema is None:
                    raise BadRequest("response_format of type json_schema needs json_schema.schema", "response_format")
                given.append(("response_format", {"json": rf.json_schema.json_schema}))
            else:
                raise BadRequest(f"response_format type {rf.type!r} is not supported; use text, json_object or json_schema", "response_format")
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise BadRequest(f"give only one output constraint; got {names}", given[1][0])
        name, fields = given[0]
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc), name) from None

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments common to both endpoints (None: SamplingParams' default)."""
        kw: dict[str, Any] = dict(
            n=self.n if self.n is not None else 1,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty if self.presence_penalty is not None else 0.0,
            frequency_penalty=self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k if self.top_k is not None else 0,
            min_p=self.min_p if self.min_p is not None else 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
        )
        return kw


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        kw = self.sampling_kwargs()
        kw["max_tokens"] = max_tokens
        kw["logprobs"] = self.logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            kw["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return SamplingParams(**kw)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0, le=20)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's older name of tools
    function_call: str | dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        check_tools(self.tools)
        self.resolved_tool_choice()
        if self.functions and self.function_call != "none":
            raise BadRequest("function calling is not supported by this server", "functions")
        if self.echo:
            raise BadRequest("echo is not supported for chat completions", "echo")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")

    def resolved_tool_choice(self) -> ToolChoice:
        """tool_choice as vLLM reads it: "auto" when tools come without one (a 400 for a bad one)."""
        return resolve_tool_choice(self.tools, self.tool_choice)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None, **overrides: Any) -> SamplingParams:
        """SamplingParams for the request; `overrides` replace computed fields (the server's output
        constraint for tool calls or reasoning, skip_special_tokens for a tool parser's markers)."""
        kw = self.sampling_kwargs()
        kw["max_tokens"] = max_tokens
        kw["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        kw.update(overrides)
        return SamplingParams(**kw)


class TokenizeRequest(RequestBody):
    """/tokenize: a prompt (completions style) or messages (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first has id, type and name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # the reasoning (--reasoning-parser), as vLLM names it
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    # Only the keys this chunk carries: role, content, reasoning_content, tool_calls (DeltaToolCall dicts).
    delta: dict[str, Any]
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[Any] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
