"""What a chat request's tools ask for: the tool definitions and tool_choice checked (a 400 naming
the field), the tool choice resolved, the JSON schema that forces calls for tool_choice "required"
or a named function (vLLM's shapes), and the history's tool calls made ready for chat templates.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.errors import BadRequest

_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """mode: "none" | "auto" | "required" | "named" (then `function` is the name)."""

    mode: str
    function: str | None = None


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool is {"type": "function", "function": {"name": str, "description"?, "parameters"?: object}}."""
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object", "tools")
        if tool.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be 'function', got {tool.get('type')!r}", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise BadRequest(f"{where}.function must be an object with a 'name'", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}.function.name must be a non-empty string", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"{where}.function.parameters must be a JSON schema object", "tools")


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolChoice:
    """The request's tool choice (vLLM's rules): "auto" when tools come without one, "none" without
    tools; a tool choice other than "none" needs tools, and a named one a tool of that name."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise BadRequest(
                f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
                f"got {tool_choice!r}", "tool_choice",
            )
        mode, name = tool_choice, None
    else:
        function = tool_choice.get("function") if tool_choice.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise BadRequest("a named tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        mode = "named"
    if mode == "none" or (mode == "auto" and not tools):  # "auto" over no tools: nothing to call
        return ToolChoice("none")
    if not tools:
        raise BadRequest(f"tool_choice {tool_choice if mode != 'named' else name!r} needs tools", "tool_choice")
    if mode == "named" and not any(t["function"]["name"] == name for t in tools):
        raise BadRequest(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice(mode, name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    # Arguments are always an object: a tool without parameters gets "{}".
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def forced_tool_schema(tools: list[dict[str, Any]], choice: ToolChoice, parallel_tool_calls: bool | None) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None when the model chooses freely.

    "required": an array of {"name", "parameters"} objects, one alternative per tool (vLLM's shape;
    at most one item when parallel_tool_calls is false); named: that function's parameters schema.
    """
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.function)
        return copy.deepcopy(_parameters(tool))
    if choice.mode != "required":
        return None
    alternatives = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = copy.deepcopy(_parameters(tool))
        # $defs of every tool are gathered at the top of the schema, where their $refs point.
        for name, schema in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise BadRequest(f"tools define $defs {name!r} twice with different schemas, which is not supported", "tools")
            defs[name] = schema
        alternatives.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: the arguments of an assistant message's tool calls as objects
    (clients send them as JSON text, and templates write them with `tojson`), as vLLM does."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls is None:
            out.append(message)
            continue
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list", "messages")
        fixed = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadRequest(f"messages[{i}].tool_calls[{j}] must have a function with a name", "messages")
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments.strip():
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", "messages") from None
            elif not isinstance(arguments, (dict, list)):
                arguments = {}
            fixed.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": fixed})
    return out
