"""The Responses API's shapes (POST /v1/responses): text in, text out.

A request is a chat: `instructions` becomes a system message and `input` the messages after it (a
string is one user message). to_chat_request() maps it onto a ChatCompletionRequest, so the chat
template, the sampling parameters and structured output (`text.format` -> `response_format`) run
through the chat endpoint's own code. What the server cannot honour is a 400 naming the field; what
OpenAI's defaults make harmless is accepted and ignored (`store`: this server stores nothing).

The response models follow the shapes of OpenAI's API reference (and of the `openai` client's
`openai.types.responses`); stream events are plain dicts built by serving_responses.py.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.entrypoints.openai.errors import BadRequest
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    OpenAIBaseModel,
    RequestBody,
    ResponseFormat,
)

# Chat roles an input message may have; OpenAI's "developer" is sent to the template as "system",
# the role chat templates know.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Content parts that carry text: the user's, and the assistant's own earlier output sent back as history.
_TEXT_PARTS = ("input_text", "output_text", "text")
# Input items of tool calling and reasoning: refused until tool calling is wired into this API.
_TOOL_ITEMS = ("function_call", "function_call_output", "reasoning", "custom_tool_call", "custom_tool_call_output")

TOOLS_NOT_SUPPORTED = "tool calling in the Responses API is not supported yet"


def _shown(value: Any) -> str:
    """A client's value in a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------- requests


class ResponseTextFormat(OpenAIBaseModel):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar always holds the output to the schema


class ResponseTextConfig(OpenAIBaseModel):
    format: ResponseTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: ResponseTextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # OpenAI's default: "auto"
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None  # given back in the response
    # Accepted and ignored: OpenAI's defaults make them harmless here.
    store: bool | None = None  # nothing is stored, whatever this says
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: there is nothing to pad
    truncation: Literal["auto", "disabled"] | None = None
    # Refused when set: each would change the answer in a way this server cannot.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # vLLM's extra sampling parameters (as in chat completions)
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def check(self) -> None:
        """A 400 for what this server cannot do, naming the field."""
        if self.previous_response_id is not None:
            raise BadRequest("previous_response_id is not supported: this server stores no responses; send the "
                             "whole conversation in input", "previous_response_id")
        if self.conversation is not None:
            raise BadRequest("conversation is not supported: this server stores no conversations; send the whole "
                             "conversation in input", "conversation")
        if self.background:
            raise BadRequest("background responses are not supported: this server stores no responses", "background")
        if self.prompt is not None:
            raise BadRequest("prompt (a stored prompt template) is not supported; send instructions and input", "prompt")
        # Encrypted reasoning items are asked for by stateless clients; this server makes no reasoning items.
        asked = [x for x in self.include or [] if x != "reasoning.encrypted_content"]
        if asked:
            raise BadRequest(f"include is not supported (got {_shown(asked)})", "include")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise BadRequest("reasoning options are not supported by this server", "reasoning")
        if self.top_logprobs:
            raise BadRequest("top_logprobs is not supported in the Responses API yet; use /v1/chat/completions", "top_logprobs")
        if self.truncation == "auto":
            raise BadRequest("truncation 'auto' is not supported: an input longer than the context is refused; "
                             "send 'disabled'", "truncation")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise BadRequest("text.verbosity other than 'medium' is not supported", "text")
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise BadRequest(f"tools[{i}]: tools of type {_shown(kind)} are not supported; only function tools "
                                 f"are, and {TOOLS_NOT_SUPPORTED}", "tools")
            if not isinstance(tool.get("name"), str):
                raise BadRequest(f"tools[{i}]: a function tool needs a string 'name'", "tools")
        # tool_choice "none" asks for no call: the tools then only reach the chat template (as in chat).
        if self.tools and self.tool_choice != "none":
            raise BadRequest(f"{TOOLS_NOT_SUPPORTED}: send tool_choice 'none' to pass tools to the chat template only", "tools")
        if self.tool_choice not in (None, "auto", "none"):
            raise BadRequest(f"{TOOLS_NOT_SUPPORTED} (tool_choice {_shown(self.tool_choice)})", "tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise BadRequest("text.format of type json_schema needs a 'schema'", "text")

    def chat_messages(self) -> list[dict[str, Any]]:
        """instructions and input as chat messages, each with its content as one string."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise BadRequest("input must not be empty", "input")
        messages.extend(_input_message(item, i) for i, item in enumerate(self.input))
        return messages

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.json_schema, strict=fmt.strict))

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Function tools in chat's shape (they only reach the chat template: tool_choice is "none")."""
        if not self.tools:
            return None
        keys = ("name", "description", "parameters", "strict")
        return [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}} for t in self.tools]

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completions request that produces this response (one choice, not streamed: streaming is
        done by the Responses handler, in its own events)."""
        tools = self.chat_tools()
        return ChatCompletionRequest(
            model=self.model,
            messages=self.chat_messages(),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            response_format=self.response_format(),
            tools=tools,
            tool_choice="none" if tools else None,
            seed=self.seed,
            stop=self.stop,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )


def _input_message(item: Any, i: int) -> dict[str, Any]:
    """One input item (OpenAI's EasyInputMessage or a message item) as a chat message."""
    where = f"input[{i}]"
    kind = item.get("type", "message")
    if kind != "message":
        if kind in _TOOL_ITEMS:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported: {TOOLS_NOT_SUPPORTED}", "input")
        raise BadRequest(f"{where}: items of type {_shown(kind)} are not supported; send messages (role and content)", "input")
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}; got {_shown(role)}", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind in _TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part_kind == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
            elif part_kind in _TEXT_PARTS or part_kind == "refusal":
                raise BadRequest(f"{where}.content[{j}]: a {part_kind} part needs a string "
                                 f"'{'refusal' if part_kind == 'refusal' else 'text'}'", "input")
            else:
                raise BadRequest(f"{where}.content[{j}]: parts of type {_shown(part_kind)} are not supported; "
                                 "this server takes text only (input_text)", "input")
        content = "\n".join(texts)  # as chat joins a list of text parts
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of input_text parts", "input")
    return {"role": _ROLES[role], "content": content}


# ---------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


def response_usage(input_tokens: int, output_tokens: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens)


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # nothing is stored, whatever the request said
    background: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
