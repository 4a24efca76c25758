"""What every request body must be, whatever its fields: checked once, on the parsed JSON, before pydantic.

- Text must be valid Unicode. JSON's escapes can spell a lone surrogate ("\\ud800"), which Python keeps
  in a str but which no tokenizer, regex engine or UTF-8 encoder takes.
- Nesting is at most MAX_JSON_DEPTH levels. The chat template code (transformers) copies messages,
  tools and kwargs recursively; deep nesting would be a RecursionError there.
- Integers fit in a signed 64-bit integer, and numbers are finite (Python's json reads NaN, Infinity and
  1e999): the engine turns token ids, seeds, top_k and the like into int64 tensors.

The walk is iterative (it never recurses, however deep the body) and builds a field path only for
containers, so a long list of token ids costs one pass over plain values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# Generous for JSON schemas in tools and response_format; a chat message with text parts is 5 deep.
MAX_JSON_DEPTH = 64

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN_PATH_PARTS = 8  # a path deeper than this is shortened in messages


@dataclass(frozen=True)
class BodyProblem:
    message: str
    param: str | None  # the top-level field it is in


def _path_text(path: tuple[Any, ...]) -> str:
    shown = path if len(path) <= _SHOWN_PATH_PARTS else path[: _SHOWN_PATH_PARTS - 1]
    text = ""
    for part in shown:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + (part if len(part) <= 40 else part[:37] + "...")
    if len(shown) < len(path):
        text += "..."
    return text or "the request body"


def _problem(path: tuple[Any, ...], what: str) -> BodyProblem:
    param = path[0] if path and isinstance(path[0], str) else None
    return BodyProblem(f"{_path_text(path)} {what}", param)


def _text_problem(text: str) -> str | None:
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    if m is None:
        return None
    return f"is not valid Unicode: it holds the lone surrogate U+{ord(m.group()):04X} at index {m.start()}"


def _scalar_problem(value: Any) -> str | None:
    """What is wrong with a JSON string or number (None: nothing); containers are walked by the caller."""
    kind = type(value)
    if kind is str:
        return _text_problem(value)
    if kind is int:
        if not INT64_MIN <= value <= INT64_MAX:
            return "is out of range: integers must fit in a signed 64-bit integer"
    elif kind is float and not math.isfinite(value):
        return "must be a finite number"
    return None


def _int_list_in_range(node: dict | list) -> bool:
    """Whether node is a list of ints only, all within int64 (False: walk it to find what is wrong)."""
    if type(node) is not list or not node or type(node[0]) is not int:
        return False
    return set(map(type, node)) == {int} and INT64_MIN <= min(node) and max(node) <= INT64_MAX


def find_body_problem(body: Any, max_depth: int = MAX_JSON_DEPTH) -> BodyProblem | None:
    """The first thing in a parsed JSON body that no request may hold (None: nothing)."""
    if not isinstance(body, (dict, list)):
        what = _scalar_problem(body)
        return None if what is None else _problem((), what)
    stack: list[tuple[dict | list, tuple[Any, ...], int]] = [(body, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            return _problem(path, f"is nested too deeply: JSON in a request may be at most {max_depth} levels deep")
        if _int_list_in_range(node):  # token ids: checked by C loops, not one Python step per id
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if type(key) is str and _text_problem(key) is not None:  # the key itself is never shown
                return BodyProblem(f"a key in {_path_text(path)} is not valid Unicode (it holds a lone surrogate)",
                                   path[0] if path and isinstance(path[0], str) else None)
            if isinstance(value, (dict, list)):
                stack.append((value, path + (key,), depth + 1))
                continue
            what = _scalar_problem(value)
            if what is not None:
                return _problem(path + (key,), what)
    return None
