"""Tool calling in POST /v1/chat/completions, driven by the official openai client.

In process, over a scripted engine (SmolLM2's tokenizer with a Qwen-style tools template): tool_choice
"auto" with the hermes parser (whole and streamed, the stream accumulated by openai's own
ChatCompletionStreamState), "required" and named choices asking the engine for vLLM's JSON schemas,
the history's tool calls and results through the template, and every refusal a 400 naming its field.
End to end (`tokenmill serve` on a tiny random-weight Llama with that tokenizer and template): a
weather round trip forced with "required" -- call, tool result, final answer -- streamed and not;
structured output makes the arguments parse and match the schema whatever the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

from tokenmill.entrypoints.openai.api_server import ServerSettings  # noqa: E402
from tokenmill.entrypoints.openai.chat_output import OutputParsing  # noqa: E402
from tokenmill.entrypoints.openai.cli_args import add_server_args  # noqa: E402

from chat_fakes import (  # noqa: E402
    TIME_TOOL,
    WEATHER_PARAMETERS,
    WEATHER_TOOL,
    ScriptedEngine,
    build_tiny_chat_model,
    make_client,
    smollm2_tools_tokenizer,
)
from server_utils import RemoteServer  # noqa: E402

TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
# Qwen2.5-style output with two parallel calls, after a sentence of content
QWEN_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tools_tokenizer()


@pytest.fixture()
def engine(tokenizer):
    return ScriptedEngine(tokenizer)



@pytest.fixture()
def client(engine):
    with make_client(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as c:
        yield c


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def streamed(client, **kw):
    """(the final completion as openai's own stream accumulator builds it, the chunks)."""
    state = ChatCompletionStreamState(input_tools=kw.get("tools", openai.omit))
    chunks = list(client.chat.completions.create(model="fake", stream=True, **kw))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ------------------------------------------------------------------ tool_choice "auto" (a parser)


def test_auto_needs_the_flags(engine):
    with make_client(engine) as plain:
        for extra in ({}, {"tool_choice": "auto"}):  # tools without a tool_choice mean "auto", as in vLLM
            err = bad_request(lambda: plain.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, **extra))
            assert err["param"] == "tool_choice"
            assert err["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        r = plain.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="none")
        assert r.choices[0].message.content == "Hello!" and not r.choices[0].message.tool_calls
        assert "<tools>" in engine.last_prompt and '"name": "get_weather"' in engine.last_prompt  # tools reach the template
    with make_client(engine, tool_call_parser="hermes") as no_auto:  # a parser alone is not enough (vLLM's rule)
        assert "--enable-auto-tool-choice" in bad_request(
            lambda: no_auto.chat.completions.create(model="fake", messages=ASK, tools=TOOLS))["message"]


def test_auto_hermes_whole(client, engine):
    engine.script = pieces(QWEN_CALLS)
    r = client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert engine.last_params.structured_outputs is None  # "auto" leaves the model free
    assert engine.last_params.skip_special_tokens is False  # hermes markers may be special tokens (vLLM's choice)


def test_auto_hermes_streamed(client, engine):
    engine.script = pieces(QWEN_CALLS)
    final, chunks = streamed(client, messages=ASK, tools=TOOLS)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("<" in (d.content or "") or "{" in (d.content or "") for d in deltas)  # nothing of a call leaks
    tool_deltas = [t for d in deltas for t in d.tool_calls or []]
    first = {}
    for t in tool_deltas:
        if t.index not in first:  # each call opens with its id, type and name, and no arguments yet
            first[t.index] = t
            assert t.id and t.type == "function" and t.function.name and t.function.arguments == ""
        else:
            assert t.id is None and t.function.name is None and t.function.arguments
    assert len(first) == 2 and sum(1 for t in tool_deltas if t.index == 0) > 3  # arguments come in fragments


def test_auto_plain_answer(client, engine):
    engine.script = pieces("It is sunny in Paris <3, 22 °C.")
    r = client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris <3, 22 °C." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    final, _ = streamed(client, messages=ASK, tools=TOOLS)
    assert final.choices[0].message.content == "It is sunny in Paris <3, 22 °C." and final.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(client, engine):
    engine.script = pieces(QWEN_CALLS)
    r = client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [name for name, _ in calls_of(r.choices[0].message)] == ["get_weather"]
    final, _ = streamed(client, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [name for name, _ in calls_of(final.choices[0].message)] == ["get_weather"]


def test_n_choices_are_parsed_each(client, engine):
    engine.script = pieces(QWEN_CALLS)
    final, _ = streamed(client, messages=ASK, tools=TOOLS, n=2)
    assert [len(c.message.tool_calls) for c in final.choices] == [2, 2]
    ids = [t.id for c in final.choices for t in c.message.tool_calls]
    assert len(set(ids)) == 4


# ------------------------------------------------------------------ "required" and named: structured output


def test_required_asks_for_vllms_schema(engine):
    engine.script = pieces('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                           '{"name": "get_time", "parameters": {}}]')
    with make_client(engine) as c:  # no parser needed: the grammar fixes the format
        r = c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="required")
        so = engine.last_params.structured_outputs
        assert so.disable_any_whitespace and so.json == {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER_PARAMETERS},
                 "required": ["name", "parameters"]},
                {"properties": {"name": {"type": "string", "enum": ["get_time"]}, "parameters": {"type": "object", "properties": {}}},
                 "required": ["name", "parameters"]},
            ]},
        }
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        want = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
        assert calls_of(r.choices[0].message) == want
        final, _ = streamed(c, messages=ASK, tools=TOOLS, tool_choice="required")
        assert calls_of(final.choices[0].message) == want and final.choices[0].finish_reason == "tool_calls"
        c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert engine.last_params.structured_outputs.json["maxItems"] == 1


def test_named_tool_choice_asks_for_the_functions_schema(engine):
    engine.script = pieces('{"city": "Tokyo", "unit": "fahrenheit"}')
    with make_client(engine) as c:
        r = c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice=NAMED)
        assert engine.last_params.structured_outputs.json == WEATHER_PARAMETERS
        assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Tokyo", "unit": "fahrenheit"})]
        assert r.choices[0].finish_reason == "tool_calls"
        final, chunks = streamed(c, messages=ASK, tools=TOOLS, tool_choice=NAMED)
        assert calls_of(final.choices[0].message) == [("get_weather", {"city": "Tokyo", "unit": "fahrenheit"})]
        # the name goes out before the model has written anything
        first_tool = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls)
        assert first_tool.function.name == "get_weather" and first_tool.function.arguments == ""


def test_cut_off_calls_keep_finish_reason_length(engine):
    engine.script = pieces('{"city": "Tokyo", "unit": "fahrenheit"}')
    with make_client(engine) as c:
        r = c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=4)
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "To'  # 4 steps of 3 characters


# ------------------------------------------------------------------ the history and refusals


def test_tool_calls_and_results_go_through_the_template(client, engine):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22}'},
    ]
    client.chat.completions.create(model="fake", messages=history, tools=TOOLS, tool_choice="none")
    prompt = engine.last_prompt
    # the arguments reach the template as an object (written with tojson), not as a JSON string in a string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 22}\n</tool_response><|im_end|>' in prompt
    history[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    err = bad_request(lambda: client.chat.completions.create(model="fake", messages=history, tools=TOOLS, tool_choice="none"))
    assert err["param"] == "messages" and "tool_calls[0].function.arguments is not valid JSON" in err["message"]


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", "tools[0].type must be 'function'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}], "tool_choice": "none"}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "none"}, "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
])
def test_bad_tool_requests_are_400s(client, extra, param, message):
    err = bad_request(lambda: client.chat.completions.create(model="fake", messages=ASK, **extra))
    assert err["param"] == param and message in err["message"], err


def test_mistral_keeps_special_tokens_only_for_auto(engine):
    with make_client(engine, tool_call_parser="mistral", enable_auto_tool_choice=True) as c:
        engine.script = pieces('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]<|im_end|>')
        r = c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
        assert engine.last_params.skip_special_tokens is False
        assert calls_of(r.choices[0].message) == [("get_time", {})] and len(r.choices[0].message.tool_calls[0].id) == 9
        c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS, tool_choice="none")
        assert engine.last_params.skip_special_tokens is True


def test_start_up_errors():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose from hermes, llama3_json, mistral, pythonic"):
        OutputParsing(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        ServerSettings(enable_auto_tool_choice=True).output_parsing()
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--tool-call-parser", "pythonic", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser) == ("pythonic", True, "qwen3")
    # the CLI refuses before loading any model
    run = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--enable-auto-tool-choice"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "error: --enable-auto-tool-choice requires --tool-call-parser" in run.stderr
    run = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--tool-call-parser", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'nope'" in run.stderr


# ------------------------------------------------------------------ end to end: a tiny model, forced calls


@pytest.fixture(scope="module")
def tiny_tool_model(tmp_path_factory, tokenizer) -> str:
    """A tiny seeded random Llama over SmolLM2's vocabulary, saved with the tools tokenizer and template."""
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny_tools")), tokenizer)


@pytest.fixture(scope="module")
def server(tiny_tool_model):
    srv = RemoteServer(["--model", tiny_tool_model, "--served-model-name", "tiny", "--max-model-len", "1024",
                        "--kv-cache-memory", str(64 << 20), "--dtype", "float32",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


def valid_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"}
    assert args["city"] in WEATHER_PARAMETERS["properties"]["city"]["enum"]
    assert args["unit"] in WEATHER_PARAMETERS["properties"]["unit"]["enum"]
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_weather_round_trip_forced_with_required(server, stream):
    with server.client() as c:
        kw = dict(model="tiny", tools=TOOLS, temperature=0, max_tokens=64)
        ask = dict(messages=ASK, tool_choice="required", parallel_tool_calls=False, **kw)
        if stream:
            state = ChatCompletionStreamState(input_tools=TOOLS)
            for chunk in c.chat.completions.create(stream=True, **ask):
                state.handle_chunk(chunk)
            first = state.get_final_completion()
        else:
            first = c.chat.completions.create(**ask)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content  # a stream's role chunk has content ""
        [call] = choice.message.tool_calls  # parallel_tool_calls=false: one item at most
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        if call.function.name == "get_weather":
            valid_weather(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}

        result = json.dumps({"temperature": 22, "unit": "celsius", "sky": "sunny"})
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        if stream:
            chunks = list(c.chat.completions.create(messages=history, tool_choice="none", stream=True,
                                                    stream_options={"include_usage": True}, **{**kw, "max_tokens": 8}))
            answer = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            usage = chunks[-1].usage
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
        else:
            second = c.chat.completions.create(messages=history, tool_choice="none", **{**kw, "max_tokens": 8})
            answer, usage = second.choices[0].message.content, second.usage
            assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
        assert isinstance(answer, str) and usage.completion_tokens > 0
        # the call and its result are in the prompt the model saw
        r = httpx.post(server.url("/tokenize"), json={"model": "tiny", "messages": history, "tools": TOOLS}, timeout=30)
        ids = r.json()["tokens"]
        assert usage.prompt_tokens == len(ids)
        text = httpx.post(server.url("/detokenize"), json={"model": "tiny", "tokens": ids}, timeout=30).json()["prompt"]
        assert f'<tool_response>\n{result}\n</tool_response>' in text
        assert f'{{"name": "{call.function.name}", "arguments": {json.dumps(json.loads(call.function.arguments))}}}' in text


def test_named_tool_choice_end_to_end(server):
    with server.client() as c:
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=64)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        valid_weather(call.function.arguments)
        # a stream of the same greedy request adds up to the same arguments
        state = ChatCompletionStreamState(input_tools=TOOLS)
        for chunk in c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                               max_tokens=64, stream=True):
            state.handle_chunk(chunk)
        assert state.get_final_completion().choices[0].message.tool_calls[0].function.arguments == call.function.arguments
