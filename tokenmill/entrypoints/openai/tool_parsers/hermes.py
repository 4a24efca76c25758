"""hermes: calls as JSON objects between <tool_call> tags (Hermes 2 Pro, Qwen2 / Qwen2.5 / Qwen3,
and the many models trained on that format):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content (whitespace next to a call dropped). A block whose JSON has no
"name" stays text; a last block without its closing tag still counts (models stop at EOS).
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, classify_call, hold_back
from tokenmill.entrypoints.openai.tool_parsers.json_scan import scan_object, skip_ws

START = "<tool_call>"
END = "</tool_call>"


def _block(text: str, start: int, end: int, closed: bool) -> tuple[str, PartialCall | None]:
    """What the block text[start:end] holds: ("call" | "pending" | "not_call", call)."""
    body = text[start:end]
    i = skip_ws(body, 0)
    if i == len(body):
        return ("not_call" if closed else "pending"), None
    if body[i] != "{":
        return "not_call", None
    return classify_call(body, scan_object(body, i, final=closed), closed, ("arguments", "parameters"))


class HermesToolParser(ToolParser):
    name = "hermes"
    keep_special_tokens = True  # Hermes 2 Pro's <tool_call> is a special token (vLLM keeps them too)
    markers = (START, END)

    def parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[PartialCall] = []
        pos = search = 0  # content runs from pos; the next tag is looked for from search
        after_call = False
        while True:
            s = text.find(START, search)
            if s == -1:
                tail = text[pos:]
                if after_call:
                    tail = tail.lstrip()
                content.append(tail if final else hold_back(tail, (START,)))
                break
            e = text.find(END, s + len(START))
            closed = e != -1 or final
            kind, call = _block(text, s + len(START), e if e != -1 else len(text), closed)
            if kind == "not_call":  # the tag was text: go on looking after it
                search = s + len(START)
                continue
            before = text[pos:s]
            if after_call:
                before = before.lstrip()
            content.append(before.rstrip())
            if kind == "pending":
                break
            calls.append(call)
            after_call = True
            if e == -1:
                break
            pos = search = e + len(END)
        return Parsed("".join(content), calls)
