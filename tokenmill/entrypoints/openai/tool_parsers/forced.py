"""Parsers of the outputs that tool_choice "required" and a named tool_choice force with
structured output (chat_tools.py builds the JSON schemas; vLLM's shapes):

    required:   [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    named:      {"city": "Paris"}            (the arguments of the named function)

The grammar guarantees the shape, so these only cut the text into calls, as it streams.
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, scan_call_array
from tokenmill.entrypoints.openai.tool_parsers.json_scan import skip_ws


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i == len(text) or text[i] != "[":
            return Parsed("")
        calls, _ = scan_call_array(text, i, final, ("parameters", "arguments"))
        return Parsed("", calls)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parsed:
        # Trailing whitespace is held back while the output runs, and dropped at its end.
        return Parsed("", [PartialCall(self.function_name, text.strip())])
