"""Where JSON values end in text that may stop midway (a model's output so far).

Tool-call parsers stream a call's arguments as the model writes them: they need to know, in text
that is a prefix of the final output, which keys an object has so far and where each value starts
and (if it has) ends, without parsing the values. Strings are skipped with a regex and brackets
are counted; values are not validated here (the client gets the model's own JSON text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable

_WS = re.compile(r"[ \t\r\n]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a complete JSON string
_STRUCTURE = re.compile(r'[{}\[\]"]')
_LITERAL = re.compile(r"[A-Za-z0-9+\-.]+")  # numbers, true, false, null


class JSONScanError(ValueError):
    """The text cannot go on to be JSON of the expected shape."""


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """The index just past the JSON value that starts at text[i], or None when the text ends first.

    A number or literal running to the end of the text may still go on, unless `final`."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else None
    if c in "{[":
        depth, j = 0, i
        while True:
            m = _STRUCTURE.search(text, j)
            if m is None:
                return None
            k = m.start()
            if m.group() == '"':
                s = _STRING.match(text, k)
                if s is None:
                    return None
                j = s.end()
                continue
            depth += 1 if m.group() in "{[" else -1
            j = k + 1
            if depth == 0:
                return j
    m = _LITERAL.match(text, i)
    if m is None:
        raise JSONScanError(f"unexpected {c!r} at {i}")
    if m.end() == len(text) and not final:
        return None
    return m.end()


@dataclass
class ObjectScan:
    """An object's keys so far: key -> (value start, value end or None while unfinished)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # just past the closing brace; None while open
    error: bool = False  # the text cannot go on as a JSON object


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """Scan the object that starts with the '{' at text[i] (as far as the text goes)."""
    out = ObjectScan()
    n = len(text)
    i += 1
    first = True
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if not first:
            if text[i] != ",":
                out.error = True
                return out
            i = skip_ws(text, i + 1)
            if i >= n:
                return out
        if text[i] != '"':
            out.error = True
            return out
        m = _STRING.match(text, i)
        if m is None:  # the key is still being written
            return out
        try:
            key = json.loads(m.group())
        except ValueError:
            out.error = True
            return out
        i = skip_ws(text, m.end())
        if i >= n:
            return out
        if text[i] != ":":
            out.error = True
            return out
        i = skip_ws(text, i + 1)
        if i >= n:
            return out
        try:
            end = value_end(text, i, final)
        except JSONScanError:
            out.error = True
            return out
        out.fields[key] = (i, end)
        if end is None:
            return out
        i = end
        first = False


def string_value(text: str, span: tuple[int, int | None] | None) -> str | None:
    """The value of a finished JSON string field (None if missing, unfinished or not a string)."""
    if span is None or span[1] is None:
        return None
    try:
        value = json.loads(text[span[0] : span[1]])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def arguments_text(text: str, scan: ObjectScan, keys: Iterable[str], final: bool) -> str:
    """A call's arguments as JSON text so far (a prefix of the final text).

    The model's own text of the value (an object, as models write it); a value given as a
    JSON-encoded string is decoded once complete. No arguments key in a finished object: "{}".
    """
    span = next((scan.fields[k] for k in keys if k in scan.fields), None)
    if span is None:
        return "{}" if (scan.end is not None or scan.error or final) else ""
    start, end = span
    raw = text[start : end if end is not None else len(text)]
    if raw.startswith('"'):
        if end is None:
            return ""  # wait for the whole string: its escapes decode only as a whole
        try:
            decoded = json.loads(raw)
        except ValueError:
            return raw
        return decoded if isinstance(decoded, str) else raw
    return raw
