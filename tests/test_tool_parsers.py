"""Tool-call parsers against recorded model outputs of each format (no model, no server).

Each output is parsed whole (`extract`) and streamed in pieces (every character alone, and random
splits): the stream must add up to exactly the whole parse, show each call's id and name first and
then argument fragments, and never show as content what turns out to be part of a call."""

from __future__ import annotations

import json
import random
import re

import pytest

from tokenmill.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    get_tool_parser,
)
from tokenmill.entrypoints.openai.tool_parsers.json_scan import scan_object, value_end

# (parser, recorded output, expected content, expected [(name, arguments as a dict)])
RECORDED = [
    # Qwen2.5-7B-Instruct, two parallel calls (Qwen's function-calling guide)
    ("hermes",
     '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
     '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
     None,
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})]),
    # Text before the call; nested arguments with braces inside strings
    ("hermes",
     'Let me look that up for you.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "a } and a { in text", '
     '"filters": {"year": [2023, 2024], "tags": ["x", "y"]}, "exact": true, "limit": null}}\n</tool_call>',
     "Let me look that up for you.",
     [("search", {"query": "a } and a { in text", "filters": {"year": [2023, 2024], "tags": ["x", "y"]}, "exact": True,
                  "limit": None})]),
    # Hermes-2-Pro writes "arguments" before "name"; the last block without its closing tag (stopped at EOS)
    ("hermes",
     '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"symbol": "AAPL"}, "name": "get_stock_fundamentals"}',
     None,
     [("get_stock_fundamentals", {"symbol": "TSLA"}), ("get_stock_fundamentals", {"symbol": "AAPL"})]),
    # Arguments as a JSON-encoded string, unicode and escapes
    ("hermes",
     '<tool_call>\n{"name": "translate", "arguments": "{\\"text\\": \\"caf\\u00e9 \\\\\\"ol\\u00e9\\\\\\"\\", \\"to\\": \\"日本語\\"}"}\n</tool_call>',
     None,
     [("translate", {"text": 'café "olé"', "to": "日本語"})]),
    # A plain answer, with tag-like text that is not a tag
    ("hermes", "Use a < b and <tool> tags; x <tool_cal is not one.", "Use a < b and <tool> tags; x <tool_cal is not one.", []),
    # A "tool call" without JSON stays text
    ("hermes", "<tool_call>get_weather Paris</tool_call> then", "<tool_call>get_weather Paris</tool_call> then", []),
    # Llama-3.1-8B-Instruct
    ("llama3_json",
     '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
     None, [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    # Llama-3.2-3B-Instruct: <|python_tag|> kept, two calls separated by "; "
    ("llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "arguments": {"city": "Oslo"}}',
     None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),  # JSON, but no call
    # Mistral-7B-Instruct-v0.3 (special tokens kept: [TOOL_CALLS] and the EOS)
    ("mistral",
     '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
     '{"name": "get_time", "arguments": {}}]</s>',
     None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"}), ("get_time", {})]),
    # Mistral-Small-3.2 (v11+ tokenizer): name[ARGS]{...}, one [TOOL_CALLS] per call, text before
    ("mistral",
     'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
     "Sure.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("mistral", "No tools needed [here].", "No tools needed [here].", []),
    # Llama-3.2-3B-Instruct, pythonic
    ("pythonic",
     "[get_weather(city='San Francisco', metric='celsius'), get_time(timezone=\"PST\"), ping()]",
     None, [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("get_time", {"timezone": "PST"}), ("ping", {})]),
    ("pythonic",
     "[register(user={'name': 'Ann', 'tags': ['a', 'b,c']}, age=30, ratio=0.5, active=True, note=None, pair=(1, 2))]",
     None, [("register", {"user": {"name": "Ann", "tags": ["a", "b,c"]}, "age": 30, "ratio": 0.5, "active": True, "note": None,
                          "pair": [1, 2]})]),
    ("pythonic", "[Note: nothing to call] Paris is sunny.", "[Note: nothing to call] Paris is sunny.", []),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]], list]:
    """Feed the pieces; (content, [(id, name, arguments)], the raw deltas), checking the deltas' order."""
    content = ""
    calls: dict[int, list[str]] = {}
    deltas = [parser.extract_streaming(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if c.name is not None:  # a call's first delta: id and name, no arguments yet
                assert c.index == len(calls) and c.id and c.arguments == ""
                calls[c.index] = [c.id, c.name, ""]
            else:
                assert c.id is None and c.index in calls and c.arguments
                calls[c.index][2] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        k = rng.choice([1, 1, 2, 3, 5, 8, 13])
        pieces.append(text[i : i + k])
        i += k
    return pieces


@pytest.mark.parametrize("name, text, content, calls", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_recorded_outputs(name, text, content, calls):
    result = get_tool_parser(name)().extract(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == calls
    assert result.tools_called == bool(calls)
    assert len({c.id for c in result.tool_calls}) == len(calls)
    want = (content or "", [(c.name, c.arguments) for c in result.tool_calls])
    splits = [list(text), [text]] + [random_pieces(text, seed) for seed in range(20)]
    for pieces in splits:
        got_content, got_calls, _ = stream(get_tool_parser(name)(), pieces)
        assert (got_content, [(n, a) for _, n, a in got_calls]) == want, pieces


def test_content_is_never_taken_back():
    """What a stream shows as content is final: the tag's first characters wait until they are known."""
    text = 'Checking.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parser = get_tool_parser("hermes")()
    shown = ""
    for ch in text:
        shown += parser.extract_streaming(ch).content
        assert "Checking.".startswith(shown), shown
    shown += parser.finish().content
    assert shown == "Checking."


def test_arguments_stream_as_they_are_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    parser = get_tool_parser("hermes")()
    deltas = [parser.extract_streaming(ch) for ch in text]
    pieces = [c for d in deltas for c in d.tool_calls]
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert text[: first + 1].endswith('"get_weather"')  # the name is shown as soon as it is complete
    assert pieces[0].name == "get_weather" and pieces[0].arguments == ""
    fragments = [c.arguments for c in pieces[1:]]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "unit": "celsius"}'
    assert not parser.finish()


def test_a_call_cut_off_by_max_tokens_keeps_what_was_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    result = get_tool_parser("hermes")().extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Par')]
    # no name yet: nothing is a call, the text stays content
    assert get_tool_parser("hermes")().extract('<tool_call>\n{"na').content == '<tool_call>\n{"na'


def test_the_pythonic_stream_grows_one_argument_at_a_time():
    parser = get_tool_parser("pythonic")()
    seen = [parser.extract_streaming(p) for p in ["[get_weather(", "city='Par", "is', ", "unit='c'", ")", "]"]]
    # a value is complete once the "," or ")" after it is there
    assert [[c.arguments for c in d.tool_calls] for d in seen] == [["", "{"], [], ['"city": "Paris"'], [], [', "unit": "c"}'], []]


class _Tokenizer:
    all_special_tokens = ["<|im_end|>", "<|endoftext|>", "</s>", "[TOOL_CALLS]"]


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}</s>'),
])
def test_special_tokens_other_than_markers_are_dropped(name, text):
    parser_class = get_tool_parser(name)
    assert parser_class.keep_special_tokens
    result = parser_class(_Tokenizer()).extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": 1}')] and result.content is None
    plain = parser_class(_Tokenizer()).extract("Just text.<|im_end|></s>")
    assert plain.content == "Just text." and not plain.tool_calls


def test_mistral_call_ids_are_nine_alphanumerics():
    result = get_tool_parser("mistral")().extract('[TOOL_CALLS]f[ARGS]{}')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", result.tool_calls[0].id)
    assert re.fullmatch(r"call_[0-9a-f]{24}", get_tool_parser("hermes")().extract('<tool_call>{"name": "f"}</tool_call>').tool_calls[0].id)


def test_required_and_named_outputs():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    result = RequiredToolParser().extract(text)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for seed in range(10):
        content, calls, _ = stream(RequiredToolParser(), random_pieces(text, seed))
        assert content == "" and [(n, a) for _, n, a in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    # named: the whole output is the function's arguments; the name is known before any text
    parser = NamedToolParser("get_weather")
    first = parser.extract_streaming("")
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("get_weather", "")]
    content, calls, _ = stream(NamedToolParser("get_weather"), random_pieces(' {"city": "Paris"} \n', 3))
    assert [(n, a) for _, n, a in calls] == [("get_weather", '{"city": "Paris"}')]


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose from hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")


def test_json_scan():
    text = '{"name": "f", "arguments": {"s": "}\\"{", "n": [1, {"x": 2}]}, "k": 12'
    scan = scan_object(text, 0)
    assert set(scan.fields) == {"name", "arguments", "k"} and scan.end is None and not scan.error
    start, end = scan.fields["arguments"]
    assert json.loads(text[start:end]) == {"s": '}"{', "n": [1, {"x": 2}]}
    assert scan.fields["k"] == (len(text) - 2, None)  # a number at the end may go on
    assert scan_object(text, 0, final=True).fields["k"][1] == len(text)
    assert scan_object('{"a" 1}', 0).error and scan_object('{"a": 1 "b": 2}', 0).error
    assert value_end('"abc', 0) is None and value_end('[1, "]"]', 0) == 8
