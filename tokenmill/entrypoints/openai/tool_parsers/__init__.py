"""Tool-call parsers: a model's output text -> content and OpenAI tool calls.

Chosen by `tokenmill serve --tool-call-parser NAME` (vLLM's names) for tool_choice "auto":

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen2 / 2.5 / 3
    llama3_json   {"name": ..., "parameters": {...}}                          Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}]  or  [TOOL_CALLS]name[ARGS]{...}
    pythonic      [get_weather(city="Paris"), ...]                            Llama 3.2 / 4, ToolACE

Interface (one parser instance per request choice: it holds the stream's state):

    parser = get_tool_parser("hermes")(tokenizer)   # tokenizer may be None
    result = parser.extract(text)                   # ExtractedToolCalls: .content (str | None),
                                                    #   .tool_calls [ToolCall(id, name, arguments)]
    for piece in pieces_of_text:                    # streaming: the new text of each step
        d = parser.extract_streaming(piece)         # StreamDelta: .content (str), .tool_calls
        ...                                         #   [ToolCallDelta(index, arguments, id, name)]
    d = parser.finish()                             # at the end: what was held back
    parser.keep_special_tokens                      # True: run the request with skip_special_tokens=False

`arguments` is JSON text. A call's first delta carries its `id` and `name` (arguments ""), later
ones argument fragments; the stream adds up to exactly what `extract` returns for the whole text.
RequiredToolParser and NamedToolParser (forced.py) read the outputs that tool_choice "required"
and a named tool_choice force with structured output. A new format subclasses ToolParser
(base.py), implements `parse(text, final)`, and is added to TOOL_PARSERS.
"""

from __future__ import annotations

from types import MappingProxyType

from tokenmill.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from tokenmill.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from tokenmill.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tokenmill.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenmill.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tokenmill.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType({
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "NamedToolParser", "RequiredToolParser", "StreamDelta", "ToolCall",
    "ToolCallDelta", "ToolParser", "get_tool_parser",
]
