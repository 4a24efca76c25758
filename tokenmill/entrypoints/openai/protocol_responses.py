"""The Responses API's shapes (POST /v1/responses): text, function calls and reasoning.

A request is a chat: `instructions` becomes a system message and `input` the messages after it (a
string is one user message; function_call and function_call_output items become an assistant
message's tool_calls and tool messages, a reasoning item the next assistant message's
reasoning_content). to_chat_request() maps it onto a ChatCompletionRequest, so the chat template,
the sampling parameters, structured output (`text.format` -> `response_format`) and tool calling
(flat function `tools` -> chat's nested ones, `tool_choice`, `parallel_tool_calls`) run through the
chat endpoint's own code. What the server cannot honour is a 400 naming the field; what OpenAI's
defaults make harmless is accepted and ignored (`store`: this server stores nothing).

The response models follow the shapes of OpenAI's API reference (and of the `openai` client's
`openai.types.responses`); stream events are plain dicts built by serving_responses.py.
"""

from __future__ import annotations

import json
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
# Input items of custom (free-form) tools: only function tools are supported.
_CUSTOM_TOOL_ITEMS = ("custom_tool_call", "custom_tool_call_output")
_TOOL_CHOICES = ("none", "auto", "required")


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
        # Stateless clients ask for encrypted reasoning; reasoning items here carry their text in the clear.
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
                                 "({'type': 'function', 'name': ..., 'parameters': ...}) are", "tools")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise BadRequest(f"tools[{i}]: a function tool needs a non-empty string 'name'", "tools")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise BadRequest(f"tools[{i}].parameters must be a JSON schema object", "tools")
        self.chat_tool_choice()
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
        messages.extend(_input_messages(self.input))
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
        """Function tools in chat's shape: Responses' flat {"type", "name", ...} nested under "function"."""
        if not self.tools:
            return None
        keys = ("name", "description", "parameters", "strict")
        return [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}} for t in self.tools]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """tool_choice in chat's shape: a named function {"type": "function", "name"} nested under "function";
        chat resolves it (None with tools is "auto", as in OpenAI's API)."""
        choice = self.tool_choice
        if choice is None or choice in _TOOL_CHOICES:
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str) or not choice["name"]:
                raise BadRequest("a named tool_choice must be {'type': 'function', 'name': ...}", "tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        if isinstance(choice, dict):
            raise BadRequest(f"tool_choice of type {_shown(choice.get('type'))} is not supported; send 'none', 'auto', "
                             "'required' or {'type': 'function', 'name': ...}", "tool_choice")
        raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                         f"got {_shown(choice)}", "tool_choice")

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completions request that produces this response (one choice, not streamed: streaming is
        done by the Responses handler, in its own events)."""
        return ChatCompletionRequest(
            model=self.model,
            messages=self.chat_messages(),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            response_format=self.response_format(),
            tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            seed=self.seed,
            stop=self.stop,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )


def _input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages. A function_call joins the assistant message just before it (the
    text of the same turn, or the calls made in parallel with it) or starts one; a function_call_output is
    a tool message and must answer an earlier call; a reasoning item's text becomes the reasoning_content
    of the assistant message that follows it (templates such as Qwen3's show it in a tool-calling turn)."""
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    reasoning: list[str] = []  # reasoning items waiting for their assistant message

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            message = _input_message(item, where)
            if message["role"] == "assistant":
                assistant(message)
            else:
                reasoning.clear()  # reasoning not followed by an answer is dropped, as templates drop it
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise BadRequest(f"{where}: no function_call item with call_id {_shown(call_id)} comes before this "
                                 "function_call_output; send the call along with its output", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            reasoning.extend(_reasoning_texts(item, where))
        elif kind in _CUSTOM_TOOL_ITEMS:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported: only function tools are", "input")
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item references are not supported: this server stores no items; send the "
                             "items themselves", "input")
        else:
            raise BadRequest(f"{where}: items of type {_shown(kind)} are not supported; send messages (role and "
                             "content), function_call, function_call_output or reasoning items", "input")
    return messages


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a chat tool call (its arguments JSON text, checked here to name the item)."""
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise BadRequest(f"{where}: a function_call item needs a non-empty string {key!r}", "input")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise BadRequest(f"{where}.arguments must be a JSON string", "input")
    if arguments.strip():
        try:
            json.loads(arguments)
        except ValueError:
            raise BadRequest(f"{where}.arguments is not valid JSON", "input") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _text_of(value: Any, where: str) -> str:
    """A function call's output: a string, or a list of input_text parts (joined as chat joins them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise BadRequest(f"{where}[{j}]: parts of type {_shown(kind)} are not supported; this server takes "
                                 "text only (input_text with a string 'text')", "input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRequest(f"{where} must be a string or a list of input_text parts", "input")


def _reasoning_texts(item: dict[str, Any], where: str) -> list[str]:
    """The reasoning_text parts of a reasoning item (its summary and encrypted content are not the reasoning)."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a list of reasoning_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{j}] must be {{'type': 'reasoning_text', 'text': str}}", "input")
        texts.append(part["text"])
    return texts


def _input_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item (OpenAI's EasyInputMessage or a message item) as a chat message."""
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


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning (--reasoning-parser), in the clear: vLLM's shape, no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


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
    output: list[OutputItem] = Field(default_factory=list)
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
