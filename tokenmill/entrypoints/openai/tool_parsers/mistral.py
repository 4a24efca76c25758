"""mistral: Mistral's [TOOL_CALLS] token followed by the calls, in either of its formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v0.3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                            (v11 tokenizers and later)

Text before [TOOL_CALLS] is content. [TOOL_CALLS] is a special token: the server keeps special
tokens in the text of such requests (as vLLM does). Call ids are 9 alphanumeric characters, which
Mistral's chat templates require of the calls sent back in the history.
"""

from __future__ import annotations

import re

from tokenmill.entrypoints.openai.tool_parsers.base import (
    Parsed,
    PartialCall,
    ToolParser,
    hold_back,
    mistral_call_id,
    scan_call_array,
)
from tokenmill.entrypoints.openai.tool_parsers.json_scan import JSONScanError, skip_ws, value_end

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _named_calls(text: str, i: int, final: bool) -> tuple[list[PartialCall], bool]:
    """`name[ARGS]{...}` calls, each after its own [TOOL_CALLS]; (calls, whether it is not calls)."""
    calls: list[PartialCall] = []
    n = len(text)
    while True:
        a = text.find(ARGS, i)
        c = text.find(CALL_ID, i)
        name_end = min(x for x in (a, c, n) if x != -1)
        name = text[i:name_end].strip()
        if name_end == n:  # the name may go on, and a marker may be half-written
            name = hold_back(name, (ARGS, CALL_ID))
            if final or (name and not _NAME.fullmatch(name)):
                return calls, not calls
            calls.append(PartialCall(None))
            return calls, False
        if not _NAME.fullmatch(name):
            return calls, not calls
        if a == -1:  # [CALL_ID]... and [ARGS] still to come
            if final:
                calls.append(PartialCall(name, "{}"))
                return calls, False
            calls.append(PartialCall(None))
            return calls, False
        j = skip_ws(text, a + len(ARGS))
        try:
            end = value_end(text, j, final)
        except JSONScanError:
            calls.append(PartialCall(name, "{}"))
            return calls, False
        if end is None:  # the arguments go on (or were cut off)
            calls.append(PartialCall(name, text[j:] or ("{}" if final else "")))
            return calls, False
        calls.append(PartialCall(name, text[j:end]))
        i = skip_ws(text, end)
        if not text.startswith(BOT, i):
            return calls, False
        i = skip_ws(text, i + len(BOT))


class MistralToolParser(ToolParser):
    name = "mistral"
    keep_special_tokens = True
    markers = (BOT, ARGS, CALL_ID)

    def new_call_id(self) -> str:
        return mistral_call_id()

    def parse(self, text: str, final: bool) -> Parsed:
        s = text.find(BOT)
        if s == -1:
            return Parsed(text if final else hold_back(text, (BOT,)))
        content = text[:s].rstrip()
        i = skip_ws(text, s + len(BOT))
        if i == len(text):
            return Parsed(content if not final else text[:s].rstrip())
        if text[i] == "[":
            calls, not_calls = scan_call_array(text, i, final, ("arguments", "parameters"))
        else:
            calls, not_calls = _named_calls(text, i, final)
        if not_calls:
            return Parsed(text if final else hold_back(text, (BOT,)))
        return Parsed(content, calls)
