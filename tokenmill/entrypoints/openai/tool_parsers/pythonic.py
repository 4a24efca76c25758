"""pythonic: a Python list of calls with keyword arguments (Llama 3.2 / 4, ToolACE, ...):

    [get_weather(city="Paris", unit="celsius"), get_time()]

An output that does not start with such a list is content, as in vLLM. Argument values are
Python literals, sent as JSON ({"city": "Paris", "unit": "celsius"}); a value that is not a
literal is sent as its source text, a string. While a call is written its arguments grow one
finished keyword argument at a time, so every fragment is a prefix of the final JSON.
"""

from __future__ import annotations

import ast
import json
import re

from tokenmill.entrypoints.openai.tool_parsers.base import Parsed, PartialCall, ToolParser
from tokenmill.entrypoints.openai.tool_parsers.json_scan import skip_ws

_FUNCTION = re.compile(r"[A-Za-z_][\w.]*")
_KEYWORD = re.compile(r"[A-Za-z_]\w*")
_PY_STRING = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\"""", re.DOTALL)
_PY_SCAN = re.compile(r"""['"()\[\]{},]""")


def _value_end(text: str, i: int) -> int | None:
    """Where the Python expression starting at text[i] ends (at a ',' or ')' outside brackets);
    None when the text ends first."""
    depth = 0
    j = i
    while True:
        m = _PY_SCAN.search(text, j)
        if m is None:
            return None
        ch, k = m.group(), m.start()
        if ch in "'\"":
            s = _PY_STRING.match(text, k)
            if s is None:
                return None
            j = s.end()
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return k
            depth -= 1
        elif depth == 0:  # a comma between arguments
            return k
        j = k + 1


def _to_json(source: str) -> str:
    source = source.strip()
    try:
        return json.dumps(ast.literal_eval(source), ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return json.dumps(source, ensure_ascii=False)


def _call(text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None, bool]:
    """The call whose name starts at text[i]: (call or None if it is no call, index past its ')'
    or None while open, whether the text so far may still become a call)."""
    n = len(text)
    m = _FUNCTION.match(text, i)
    if m is None:
        return None, None, False
    j = m.end()
    if j == n:
        return None, None, not final
    if text[j] != "(":
        return None, None, False
    name = m.group()
    parts: list[str] = []
    k = j + 1
    while True:
        k = skip_ws(text, k)
        if k >= n:
            break
        if text[k] == ")":
            return PartialCall(name, "{" + ", ".join(parts) + "}"), k + 1, True
        if parts:
            if text[k] != ",":
                break
            k = skip_ws(text, k + 1)
            if k >= n:
                break
            if text[k] == ")":
                continue
        km = _KEYWORD.match(text, k)
        if km is None:
            break
        eq = skip_ws(text, km.end())
        if eq >= n or text[eq] != "=":
            break
        v = skip_ws(text, eq + 1)
        end = _value_end(text, v)
        if end is None:
            break
        parts.append(f"{json.dumps(km.group())}: {_to_json(text[v:end])}")
        k = end
    # Still open (or broken): the finished arguments so far; closed when the output has ended.
    return PartialCall(name, "{" + ", ".join(parts) + ("}" if final else "")), None, True


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        n = len(text)
        i = skip_ws(text, 0)
        if i == n:
            return Parsed(text if final else "")
        if text[i] != "[":
            return Parsed(text)
        calls: list[PartialCall] = []
        i += 1
        while True:
            i = skip_ws(text, i)
            if i >= n:
                break
            if text[i] == "]":
                if not calls:
                    return Parsed(text)  # "[]" is text, not an empty list of calls
                break
            if calls:
                if text[i] != ",":
                    break
                i = skip_ws(text, i + 1)
                if i >= n:
                    break
            call, end, possible = _call(text, i, final)
            if call is None:
                if not calls and not possible:
                    return Parsed(text)
                if possible:
                    calls.append(PartialCall(None))
                break
            calls.append(call)
            if end is None:
                break
            i = end
        if not calls and final:
            return Parsed(text)
        return Parsed("", calls)
