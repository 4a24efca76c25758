"""Reasoning parsers: a thinking model's output -> reasoning_content (inside <think>...</think>) and
content (the rest). Chosen by `tokenmill serve --reasoning-parser NAME` (vLLM's names):

    qwen3         the output starts with <think> ... </think> (Qwen3; none with enable_thinking=false,
                  whose chat template puts an empty think block in the prompt): without it, all is content
    deepseek_r1   text up to </think> is reasoning, an opening <think> optional (DeepSeek-R1's template
                  puts it in the prompt; QwQ, Qwen3 *-Thinking-2507): without </think>, all is reasoning

Interface (one instance per request choice, like the tool parsers):

    parser = get_reasoning_parser("qwen3")()
    reasoning, content = parser.extract(text)       # each str | None
    r, c = parser.extract_streaming(piece)          # the new reasoning / content text (str, maybe "")
    r, c = parser.finish()                          # at the end: what was held back
    parser.reasoning_format()                       # the reasoning as an xgrammar structural-tag
                                                    #   element (reasoning_grammar.py)

Whitespace around the reasoning and at the start of the content is dropped (the template's
newlines), and a half-written tag is held back while streaming, so the stream adds up to what
`extract` gives.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar

from tokenmill.entrypoints.openai.tool_parsers.base import hold_back

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._text = ""
        self._sent = ("", "")

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning so far or None when there is none, content so far); while the output runs both
        only grow (see tool_parsers/base.py)."""
        raise NotImplementedError

    @classmethod
    def reasoning_format(cls) -> dict[str, Any]:
        """The reasoning part of an output, as an xgrammar structural-tag format."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.parse(text, final=True)
        return reasoning or None, (content if content or reasoning is None else None)

    def extract_streaming(self, delta: str) -> tuple[str, str]:
        self._text += delta
        return self._diff(*self.parse(self._text, final=False))

    def finish(self) -> tuple[str, str]:
        return self._diff(*self.parse(self._text, final=True))

    def _diff(self, reasoning: str | None, content: str) -> tuple[str, str]:
        out = []
        for new, sent in zip((reasoning or "", content), self._sent):
            out.append(new[len(sent) :] if len(new) > len(sent) and new.startswith(sent) else "")
        self._sent = (self._sent[0] + out[0], self._sent[1] + out[1])
        return out[0], out[1]


def _split(text: str, start: int, final: bool) -> tuple[str, str]:
    """(reasoning, content) of text whose reasoning starts at `start` and ends at </think>."""
    end = text.find(THINK_END, start)
    if end == -1:
        reasoning = text[start:].lstrip()
        return (reasoning.rstrip() if final else hold_back(reasoning, (THINK_END,))), ""
    return text[start:end].strip(), text[end + len(THINK_END) :].lstrip()


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        head = text.lstrip()
        if head.startswith(THINK_START):
            return _split(text, len(text) - len(head) + len(THINK_START), final)
        if not final and THINK_START.startswith(head):  # nothing yet, or a half-written <think>
            return None, ""
        return None, text

    @classmethod
    def reasoning_format(cls) -> dict[str, Any]:
        # Optional: with enable_thinking=false the template closes the think block in the prompt.
        return {"type": "optional", "content": {"type": "tag", "begin": THINK_START, "content": {"type": "any_text"}, "end": THINK_END}}


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def parse(self, text: str, final: bool) -> tuple[str | None, str]:
        head = text.lstrip()
        start = 0
        if head.startswith(THINK_START):
            start = len(text) - len(head) + len(THINK_START)
        elif not final and head and THINK_START.startswith(head):
            return "", ""
        return _split(text, start, final)

    @classmethod
    def reasoning_format(cls) -> dict[str, Any]:
        # Any text up to </think> (an opening <think> is part of it, and dropped by the parser).
        return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}


REASONING_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType({
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
})


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(REASONING_PARSERS))}") from None
