"""The tool parser interface (see the package docstring) and what every format shares.

A format implements one method, `parse(text, final) -> Parsed`: what the output so far says, the
content and the calls, each call with its name (once known) and a prefix of its arguments text.
While the output runs (`final=False`) the parse must only grow: content and arguments only get
longer, calls are never dropped, and nothing that might still turn out to be part of a call (a
half-written tag, trailing whitespace before one) is claimed as content. The base class turns
that into the whole result (`extract`) and into OpenAI-shaped deltas (`extract_streaming`), so a
stream always adds up to exactly what `extract` gives for the same text, however it is split.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

from tokenmill.entrypoints.openai.tool_parsers.json_scan import ObjectScan, arguments_text, scan_object, skip_ws, string_value


@dataclass
class ToolCall:
    """A whole call: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    content: str | None  # None when the output was only tool calls
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its first delta has `id` and `name`; later ones argument fragments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class PartialCall:
    name: str | None  # None: not known yet, so nothing of this call (or later ones) is shown
    arguments: str = ""  # a prefix of the final arguments text


@dataclass
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def hold_back(text: str, tags: Iterable[str]) -> str:
    """Text that may be shown while the output runs: without a tail that could begin one of the
    tags, and without trailing whitespace (it is dropped when a tool call follows it)."""
    cut = len(text)
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut].rstrip()


def classify_call(text: str, scan: ObjectScan, final: bool, arg_keys: tuple[str, ...]) -> tuple[str, PartialCall | None]:
    """("call", call) once the object has a string "name"; ("pending", None) while it may still get
    one; ("not_call", None) when it cannot (closed or broken without one, or a non-string name)."""
    name_span = scan.fields.get("name")
    if name_span is not None and name_span[1] is not None:
        name = string_value(text, name_span)
        if name is None:
            return "not_call", None
        return "call", PartialCall(name, arguments_text(text, scan, arg_keys, final or scan.error))
    if scan.end is not None or scan.error or final:
        return "not_call", None
    return "pending", None


def scan_call_array(text: str, i: int, final: bool, arg_keys: tuple[str, ...]) -> tuple[list[PartialCall], bool]:
    """Calls in the JSON array `[{"name": ..., <arg key>: {...}}, ...]` that starts at text[i].

    Returns the calls so far (the last may be pending: name None) and whether the array holds
    anything but calls (then it is text, unless calls came before)."""
    calls: list[PartialCall] = []
    n = len(text)
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= n or text[i] == "]":
            return calls, False
        if calls:
            if text[i] != ",":
                return calls, not calls
            i = skip_ws(text, i + 1)
            if i >= n:
                return calls, False
        if text[i] != "{":
            return calls, not calls
        scan = scan_object(text, i, final)
        kind, call = classify_call(text, scan, final, arg_keys)
        if kind == "not_call":
            return calls, not calls
        calls.append(call or PartialCall(None))
        if scan.end is None:
            return calls, False
        i = scan.end


class ToolParser:
    """Base class of the formats; one instance per request choice (it keeps the stream's state)."""

    name: ClassVar[str] = ""
    # The format's markers are special tokens: the server then keeps special tokens in the output
    # text (skip_special_tokens=False, as vLLM does), and the parser drops all but its markers.
    keep_special_tokens: ClassVar[bool] = False
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._drop: tuple[str, ...] = ()
        if self.keep_special_tokens and tokenizer is not None:
            specials = getattr(tokenizer, "all_special_tokens", None) or []
            self._drop = tuple(t for t in specials if t and t not in self.markers)
        self._text = ""
        self._content = ""  # content sent so far
        self._calls: list[tuple[str, str]] = []  # (id, arguments sent so far) per call sent

    # -- what a format implements -------------------------------------------------------
    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # -- whole output -----------------------------------------------------------------
    def extract(self, text: str) -> ExtractedToolCalls:
        parsed = self.parse(self._clean(text), final=True)
        calls = [ToolCall(self.new_call_id(), c.name, c.arguments) for c in parsed.calls if c.name is not None]
        content = parsed.content
        return ExtractedToolCalls(content if content or not calls else None, calls)

    # -- streaming --------------------------------------------------------------------
    def extract_streaming(self, delta: str) -> StreamDelta:
        """Feed the next piece of output text; returns what may be shown now."""
        self._text += delta
        return self._diff(self.parse(self._clean(self._text), final=False))

    def finish(self) -> StreamDelta:
        """The output has ended: what was held back (a tag that never came, trailing text)."""
        return self._diff(self.parse(self._clean(self._text), final=True))

    @property
    def tools_called(self) -> bool:
        """Whether the stream has shown a tool call."""
        return bool(self._calls)

    def _clean(self, text: str) -> str:
        for token in self._drop:
            if token in text:
                text = text.replace(token, "")
        return text

    def _diff(self, parsed: Parsed) -> StreamDelta:
        out = StreamDelta()
        # What was shown cannot be taken back: a parse that no longer extends it (only on broken
        # output) adds nothing to that part.
        if len(parsed.content) > len(self._content) and parsed.content.startswith(self._content):
            out.content = parsed.content[len(self._content) :]
            self._content = parsed.content
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # calls are shown in order
            if index == len(self._calls):
                call_id = self.new_call_id()
                self._calls.append((call_id, ""))
                out.tool_calls.append(ToolCallDelta(index, "", call_id, call.name))
            call_id, sent = self._calls[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.tool_calls.append(ToolCallDelta(index, call.arguments[len(sent) :]))
                self._calls[index] = (call_id, call.arguments)
        return out


def mistral_call_id() -> str:
    """Mistral's chat templates require 9 alphanumeric characters."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
