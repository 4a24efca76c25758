"""One choice's output text -> the assistant message's parts: reasoning_content, content and tool
calls, whole (a response) or as deltas (a stream). The reasoning parser takes the text first; the
tool parser reads what it leaves as content.

OutputParsing is the server's configuration (--tool-call-parser, --enable-auto-tool-choice,
--reasoning-parser), checked when the server is built; `for_request` gives a request's factory of
per-choice parsers (None when the output is plain text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.entrypoints.openai.chat_tools import ToolChoice
from tokenmill.entrypoints.openai.errors import BadRequest
from tokenmill.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from tokenmill.entrypoints.openai.serve_start import check_output_parsing
from tokenmill.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)

AUTO_TOOLS_NEED_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class MessageParts:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class MessageDelta:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """The parsers of one choice (either may be None); max_calls keeps only the first calls
    (parallel_tool_calls=false)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls

    @property
    def tools_called(self) -> bool:
        """Whether the stream has shown a tool call."""
        return self.tools is not None and self.tools.tools_called

    def whole(self, text: str) -> MessageParts:
        reasoning, content = self.reasoning.extract(text) if self.reasoning is not None else (None, text)
        if self.tools is None or content is None:
            return MessageParts(reasoning, content)
        result = self.tools.extract(content)
        calls = result.tool_calls[: self.max_calls] if self.max_calls is not None else result.tool_calls
        return MessageParts(reasoning, result.content, calls)

    def delta(self, piece: str) -> MessageDelta:
        reasoning, content = self.reasoning.extract_streaming(piece) if self.reasoning is not None else ("", piece)
        return self._with_tools(reasoning, content, final=False)

    def finish(self) -> MessageDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._with_tools(reasoning, content, final=True)

    def _with_tools(self, reasoning: str, content: str, final: bool) -> MessageDelta:
        if self.tools is None:
            return MessageDelta(reasoning, content)
        d = self.tools.extract_streaming(content) if content else StreamDelta()
        if final:
            rest = self.tools.finish()
            d = StreamDelta(d.content + rest.content, d.tool_calls + rest.tool_calls)
        calls = [c for c in d.tool_calls if self.max_calls is None or c.index < self.max_calls]
        return MessageDelta(reasoning, d.content, calls)


@dataclass(frozen=True)
class OutputParsing:
    """The server's parsers, by their registry names (ValueError at start-up for unknown ones)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        check_output_parsing(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)

    @property
    def reasoning_class(self) -> type[ReasoningParser] | None:
        return get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None

    @property
    def tool_class(self) -> type[ToolParser] | None:
        return get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None

    def check_tool_choice(self, choice: ToolChoice) -> None:
        """tool_choice "auto" needs a parser for the model's own call format (vLLM's rule and message)."""
        if choice.mode == "auto" and not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise BadRequest(AUTO_TOOLS_NEED_FLAGS, "tool_choice")

    def keeps_special_tokens(self, choice: ToolChoice) -> bool:
        tool_class = self.tool_class
        return choice.mode == "auto" and tool_class is not None and tool_class.keep_special_tokens

    def for_request(self, choice: ToolChoice, parallel_tool_calls: bool | None, tokenizer: Any) -> Callable[[], ChoiceParser] | None:
        """A factory of one ChoiceParser per choice, or None when the output is plain content."""
        reasoning_class = self.reasoning_class
        tool_class = self.tool_class if choice.mode == "auto" else None
        if reasoning_class is None and choice.mode == "none":
            return None
        max_calls = 1 if parallel_tool_calls is False else None

        def make() -> ChoiceParser:
            tools: ToolParser | None = None
            if choice.mode == "auto" and tool_class is not None:
                tools = tool_class(tokenizer)
            elif choice.mode == "required":
                tools = RequiredToolParser(tokenizer)
            elif choice.mode == "named":
                tools = NamedToolParser(choice.function or "", tokenizer)
            return ChoiceParser(reasoning_class(tokenizer) if reasoning_class else None, tools, max_calls)

        return make
