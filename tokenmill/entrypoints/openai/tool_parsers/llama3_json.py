"""llama3_json: Llama 3.1 / 3.2 / 3.3 JSON tool calls, the whole output one or more objects
(separated by ";"), optionally after <|python_tag|>:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not start with an object holding a string "name" is content, as in vLLM
("arguments" is accepted for "parameters"). Text after the calls is dropped.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, classify_call
from tokenmill.entrypoints.openai.tool_parsers.json_scan import scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        n = len(text)
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and i < n and PYTHON_TAG.startswith(text[i:]):
            return Parsed("")  # maybe the tag, still being written
        if i == n:
            return Parsed(text if final else "")
        if text[i] != "{":
            return Parsed(text)
        calls: list[PartialCall] = []
        while True:
            scan = scan_object(text, i, final)
            kind, call = classify_call(text, scan, final, _ARG_KEYS)
            if kind == "not_call":
                if not calls:
                    return Parsed(text)
                break
            calls.append(call or PartialCall(None))
            if scan.end is None:
                break
            i = skip_ws(text, scan.end)
            if i < n and text[i] in ";,":
                i = skip_ws(text, i + 1)
            if i >= n or text[i] != "{":
                break
        return Parsed("", calls)
