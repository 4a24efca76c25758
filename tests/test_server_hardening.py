"""No request can hang, starve or crash the server (the HTTP side).

In process (a scripted fake engine with SmolLM2's real tokenizer and chat template): caps on n / best_of
and prompt tokens, request-supplied chat templates refused unless trusted, template renders stopped at
their time and size limits, every body walked once (lone surrogates, deep nesting, integers beyond 64
bits, NaN are 400s, never 500s), a 500 that gives a request id and no internals, tool_choice "auto" refused
without a tool parser, several API keys, and the in-flight limits as a pure ASGI middleware.
End to end (one `tokenmill serve`): a runaway template stopped at its limit while a plain request is
served, a malformed Content-Length answered with error JSON, and the in-flight limits with real streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tokenmill.engine.engine import EngineStats  # noqa: E402
from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app  # noqa: E402
from tokenmill.entrypoints.openai.body_checks import MAX_JSON_DEPTH, find_body_problem  # noqa: E402
from tokenmill.entrypoints.openai.chat_utils import render_chat  # noqa: E402
from tokenmill.entrypoints.openai.cli_args import add_server_args  # noqa: E402
from tokenmill.entrypoints.openai.errors import BadRequest  # noqa: E402
from tokenmill.entrypoints.openai.middleware import ConcurrencyLimitMiddleware  # noqa: E402
from tokenmill.entrypoints.openai.render_limits import RenderCancelled, RenderLimitExceeded, RenderLimits, run_limited  # noqa: E402
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402

from conftest import smollm2_gguf_path  # noqa: E402
from chat_fakes import stamp_step  # noqa: E402
from server_utils import RemoteServer, sse_events  # noqa: E402

needs_model = pytest.mark.skipif(smollm2_gguf_path() is None, reason="the embedded default model is not installed")

# A template that would loop 3e8 times: it must be stopped at the time limit.
RUNAWAY = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}hello"
HI = [{"role": "user", "content": "Hi"}]


class FakeEngine:
    """Generates token 7 (text "x") per step; `mode` scripts a bug before or during the output."""

    model_name = "fake"
    max_model_len = 256

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.mode = "ok"
        self.errored = False
        self.is_running = True

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)

    async def generate(self, prompt, params, request_id):
        if self.mode == "bug":
            raise RuntimeError("secret internal detail")
        ids = list(prompt["prompt_token_ids"])
        metrics = RequestMetrics(arrival_time=time.monotonic())
        for step in range(1, params.max_tokens + 1):
            if self.mode == "midstream" and step == 2:
                raise RuntimeError("secret internal detail")
            last = step == params.max_tokens
            stamp_step(metrics, last)
            outputs = [CompletionOutput(index=i, text="x" * step, token_ids=[7] * step, finish_reason="length" if last else None)
                       for i in range(params.n)]
            yield RequestOutput(request_id, None, ids, outputs, finished=last, metrics=metrics)

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed")
    from tokenmill.loader.gguf_file import load_gguf_source

    return load_gguf_source(smollm2_gguf_path()).tokenizer


@pytest.fixture()
def engine(tokenizer):
    return FakeEngine(tokenizer)


def make_client(engine, **settings) -> TestClient:
    app = build_app(engine, ServerSettings(served_model_names=["fake"], **settings), manage_engine=False)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture()
def client(engine):
    with make_client(engine) as c:
        yield c


def _error(r, status: int, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param != "<any>":
        assert err["param"] == param, err
    return err


def _post_raw(client: TestClient, path: str, text: str):
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


COMPLETION = {"model": "fake", "prompt": "Hello", "max_tokens": 1}
CHAT = {"model": "fake", "messages": HI, "max_tokens": 1}


# ------------------------------------------------------------------ n and best_of


def test_n_and_best_of_are_capped(client, engine):
    err = _error(client.post("/v1/completions", json={**COMPLETION, "n": 1_000_000}), 400, "n")
    assert "128" in err["message"] and "--max-n" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "n": 129}), 400, "n")
    _error(client.post("/v1/completions", json={**COMPLETION, "n": 2, "best_of": 1000}), 400, "best_of")
    r = client.post("/v1/completions", json={**COMPLETION, "n": 128})
    assert r.status_code == 200 and len(r.json()["choices"]) == 128
    with make_client(engine, max_n=4) as small:
        assert "at most 4" in _error(small.post("/v1/chat/completions", json={**CHAT, "n": 5}), 400, "n")["message"]
        assert small.post("/v1/chat/completions", json={**CHAT, "n": 4}).status_code == 200


# ------------------------------------------------------------------ chat templates


def test_request_chat_template_refused_unless_trusted(client, engine):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for path, body in (("/v1/chat/completions", {**CHAT, "chat_template": template}),
                       ("/tokenize", {"messages": HI, "chat_template": template})):
        err = _error(client.post(path, json=body), 400, "chat_template")
        assert "--trust-request-chat-template" in err["message"]
    with make_client(engine, trust_request_chat_template=True) as trusted:
        assert trusted.post("/v1/chat/completions", json={**CHAT, "chat_template": template}).status_code == 200
        assert trusted.post("/tokenize", json={"messages": HI, "chat_template": template}).json()["count"] >= 1


def test_runaway_template_is_stopped_at_the_time_limit(engine):
    with make_client(engine, trust_request_chat_template=True, max_chat_template_render_seconds=0.5) as trusted:
        for path, body in (("/v1/chat/completions", {**CHAT, "chat_template": RUNAWAY}),
                           ("/tokenize", {"messages": HI, "chat_template": RUNAWAY})):
            start = time.monotonic()
            err = _error(trusted.post(path, json=body), 400, "chat_template")
            assert time.monotonic() - start < 3.0
            assert "--max-chat-template-render-seconds" in err["message"] and "0.5 s" in err["message"]
        assert trusted.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_template_output_is_limited(engine):
    huge = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"  # 100 M characters
    with make_client(engine, trust_request_chat_template=True, max_chat_template_output_chars=100_000) as c:
        start = time.monotonic()
        err = _error(c.post("/v1/chat/completions", json={**CHAT, "chat_template": huge}), 400, "chat_template")
        assert time.monotonic() - start < 3.0 and "--max-chat-template-output-chars" in err["message"]
        # The model's own template is limited too: the messages feed it.
        long_chat = {**CHAT, "messages": [{"role": "user", "content": "y" * 100_001}]}
        _error(c.post("/v1/chat/completions", json=long_chat), 400, "messages")
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("template", [
    "{{ 1 / 0 }}",  # ZeroDivisionError
    "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",  # RecursionError
    "{% for i in range(200000) %}{% endfor %}",  # OverflowError: over the sandbox's range limit
])
def test_whatever_a_request_template_raises_is_a_400(engine, template):
    with make_client(engine, trust_request_chat_template=True) as trusted:
        err = _error(trusted.post("/v1/chat/completions", json={**CHAT, "chat_template": template}), 400, "chat_template")
        assert "could not render" in err["message"]


def test_render_limits_unit(tokenizer):
    """render_chat stops a runaway template in about the limit, and restores the thread's trace function."""
    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        start = time.monotonic()
        with pytest.raises(BadRequest) as info:
            render_chat(tokenizer, HI, chat_template=RUNAWAY, limits=RenderLimits(max_seconds=0.3))
        assert 0.3 <= time.monotonic() - start < 1.5
        assert info.value.param == "chat_template"
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    with pytest.raises(RenderLimitExceeded, match="more than 60 characters"):
        run_limited(lambda: tokenizer.apply_chat_template(HI, tokenize=False, chat_template="{{ 'x' * 50 }}{{ 'y' * 50 }}"),
                    RenderLimits(max_seconds=None, max_output_chars=60))
    text = render_chat(tokenizer, HI, limits=RenderLimits())
    assert text == render_chat(tokenizer, HI) and "Hi" in text


def test_render_stops_when_nobody_waits(tokenizer):
    """A render whose client left is told to stop (render_chat_async sets the event when cancelled)."""
    stop = threading.Event()
    result: list = []

    def work() -> None:
        try:
            run_limited(lambda: tokenizer.apply_chat_template(HI, tokenize=False, chat_template=RUNAWAY),
                        RenderLimits(max_seconds=30.0), stop)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            result.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(timeout=2.0)
    assert not thread.is_alive() and isinstance(result[0], RenderCancelled)


# ------------------------------------------------------------------ every body walked once


LONE = "\\ud800"  # the JSON text of a lone surrogate


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", '{"prompt": "%s", "max_tokens": 1}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a%s"], "max_tokens": 1}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["%s"], "max_tokens": 1}' % LONE, "stop"),
    ("/v1/completions", '{"prompt": "hi", "bad_words": ["x%s"], "max_tokens": 1}' % LONE, "bad_words"),
    ("/v1/completions", '{"prompt": "hi", "model": "%s"}' % LONE, "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % LONE, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "%s": 1}]}' % LONE, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": "%s"}' % LONE, "stop"),
    ("/tokenize", '{"prompt": "%s"}' % LONE, "prompt"),
])
def test_invalid_unicode_is_a_400(client, path, text, param):
    err = _error(_post_raw(client, path, text), 400, param)
    assert "not valid Unicode" in err["message"]


def test_deep_nesting_is_a_400(client):
    deep = "[" * 900 + "]" * 900
    body = '{"messages": [{"role": "user", "content": "hi", "extra": %s}]}' % deep
    assert "nested too deeply" in _error(_post_raw(client, "/v1/chat/completions", body), 400, "messages")["message"]
    deeper = "[" * 100_000 + "]" * 100_000  # deeper than json.loads itself can go
    body = '{"messages": [{"role": "user", "content": "hi", "extra": %s}]}' % deeper
    assert "nested too deeply" in _error(_post_raw(client, "/v1/chat/completions", body), 400)["message"]
    # Within the limit (tools' JSON schemas nest): accepted, and passed to the template.
    schema: dict = {"type": "string"}
    for _ in range(20):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "none"}).status_code == 200


def test_find_body_problem_limits():
    nested: list = []
    node = nested
    for _ in range(MAX_JSON_DEPTH - 1):
        node.append([])
        node = node[0]
    assert find_body_problem(nested) is None
    node.append([])
    assert "nested too deeply" in find_body_problem(nested).message
    assert find_body_problem({"a": [1, -(2**63), 2**63 - 1, 1.5, "é", True, None]}) is None
    assert find_body_problem({"a": [{"b": 2**63}]}).message.startswith("a[0].b is out of range")


@pytest.mark.parametrize("field, value", [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", 2**64), ("min_tokens", 2**70), ("max_tokens", 2**63),
    ("n", 2**63), ("stop_token_ids", [1, 2**63]), ("allowed_token_ids", [2**80]), ("prompt", [1, 2**63]),
    ("priority", -(2**100)), ("logprobs", 2**63),
])
def test_integers_beyond_int64_are_a_400(client, field, value):
    body = {**COMPLETION, field: value}
    err = _error(client.post("/v1/completions", json=body), 400, field)
    assert "64-bit" in err["message"]


def test_unparsable_numbers_are_a_400(client):
    _error(_post_raw(client, "/v1/completions", '{"prompt": "hi", "seed": 1%s}' % ("0" * 5000)), 400)
    _error(_post_raw(client, "/v1/completions", '{"prompt": "hi", "temperature": NaN}'), 400, "temperature")
    _error(_post_raw(client, "/v1/completions", '{"prompt": "hi", "top_p": 1e999}'), 400, "top_p")
    _error(_post_raw(client, "/v1/completions", '{"prompt": "hi", "logit_bias": {"%d": 1}}' % 2**70), 400, "logit_bias")
    _error(client.post("/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"}), 400)
    _error(client.post("/detokenize", json={"tokens": [2**64]}), 400, "tokens")


# ------------------------------------------------------------------ a 500 is a bug, with a request id


def test_500_gives_a_request_id_and_no_internals(client, engine, caplog):
    engine.mode = "bug"
    with caplog.at_level(logging.ERROR):
        r = client.post("/v1/completions", json=COMPLETION)
        err = _error(r, 500)
        rid = r.headers["x-request-id"]
        assert err["message"] == f"internal server error; request id {rid} (see the server log)"
        assert "secret" not in r.text
        r = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "my-id-1"})
        assert _error(r, 500)["message"] == "internal server error; request id my-id-1 (see the server log)"
        engine.mode = "midstream"
        r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 4, "stream": True}, headers={"X-Request-Id": "my-id-2"})
        events = sse_events(r.text.split("\n"))
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "internal server error; request id my-id-2 (see the server log)"
        assert "secret" not in r.text
    logged = [rec for rec in caplog.records if rec.levelno == logging.ERROR and rec.exc_info]
    for request_id in (rid, "my-id-1", "my-id-2"):
        rec = next(rec for rec in logged if request_id in rec.getMessage())
        assert "secret internal detail" in str(rec.exc_info[1])
    engine.mode = "ok"
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


# ------------------------------------------------------------------ tools


def test_auto_tool_choice_needs_a_parser(client):
    """Without --enable-auto-tool-choice and --tool-call-parser, "auto" (the default with tools) is refused,
    as vLLM does; "required" and named choices work by structured output (tests/test_tool_calling.py)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for choice in ({}, {"tool_choice": "auto"}):
        err = _error(client.post("/v1/chat/completions", json={**CHAT, "tools": tools, **choice}), 400, "tool_choice")
        assert "--enable-auto-tool-choice and --tool-call-parser" in err["message"]
    for choice in ("none", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": choice}).status_code == 200
    assert client.post("/v1/chat/completions", json={**CHAT, "tools": []}).status_code == 200
    _error(client.post("/v1/chat/completions", json={**CHAT, "functions": [{"name": "f"}]}), 400, "functions")


# ------------------------------------------------------------------ limits an operator sets


def test_max_prompt_tokens(engine):
    with make_client(engine, max_prompt_tokens=5) as c:
        assert c.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3, 4, 5]}).status_code == 200
        err = _error(c.post("/v1/completions", json={**COMPLETION, "prompt": [1, 2, 3, 4, 5, 6]}), 400, "prompt")
        assert "6 tokens" in err["message"] and "--max-prompt-tokens" in err["message"]
        _error(c.post("/v1/completions", json={**COMPLETION, "prompt": ["Hi", "one two three four five six seven"]}), 400, "prompt")
        err = _error(c.post("/v1/chat/completions", json=CHAT), 400, "messages")  # the rendered chat has a system prompt
        assert "--max-prompt-tokens" in err["message"]
        # Counted as the engine gets it: after truncate_prompt_tokens.
        assert c.post("/v1/completions", json={**COMPLETION, "prompt": list(range(1, 20)), "truncate_prompt_tokens": 5}).status_code == 200


def test_several_api_keys(engine):
    with make_client(engine, api_keys=["k1", "k2"]) as c:
        for key in ("k1", "k2"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        _error(c.get("/v1/models", headers={"Authorization": "Bearer k3"}), 401)
        _error(c.get("/v1/models"), 401)


def test_server_options(monkeypatch):
    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_server_args(parser)
        return parser.parse_args(list(argv))

    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    args = parse()
    assert (args.api_key, args.max_n, args.max_prompt_tokens, args.max_concurrent_requests) == (None, 128, None, None)
    assert args.trust_request_chat_template is False and args.max_chat_template_render_seconds == 5.0
    assert parse("--api-key", "a", "b", "--max-n", "4").api_key == ["a", "b"]
    monkeypatch.setenv("TOKENMILL_API_KEY", "k1, k2,")
    assert parse().api_key == ["k1", "k2"]
    with pytest.raises(SystemExit):
        parse("--max-concurrent-requests", "0")


def test_concurrency_middleware_counts_every_outcome():
    """In flight from arrival to the end of the response, whatever the outcome; per key; health never refused."""

    async def scenario() -> None:
        gate = asyncio.Event()

        async def app(scope, receive, send):
            if scope["path"] == "/fail":
                raise RuntimeError("boom")
            if scope["path"] != "/health":
                await gate.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = ConcurrencyLimitMiddleware(app, max_total=2, max_per_key=1)

        async def call(path: str = "/v1/completions", client: str = "10.0.0.1") -> list:
            sent: list = []

            async def send(message) -> None:
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {"type": "http", "method": "POST", "path": path, "client": (client, 1234), "headers": []}
            await mw(scope, receive, send)
            return sent

        def status(sent: list) -> int:
            return sent[0]["status"]

        a = asyncio.ensure_future(call(client="10.0.0.1"))
        await asyncio.sleep(0)
        per_key = await call(client="10.0.0.1")
        assert status(per_key) == 429
        assert dict(per_key[0]["headers"])[b"retry-after"] == b"1"
        err = json.loads(per_key[1]["body"])["error"]
        assert err["type"] == "RateLimitError" and err["code"] == 429 and "--max-concurrent-requests-per-key" in err["message"]
        b = asyncio.ensure_future(call(client="10.0.0.2"))
        await asyncio.sleep(0)
        overall = await call(client="10.0.0.3")
        assert status(overall) == 429 and "--max-concurrent-requests)" in json.loads(overall[1]["body"])["error"]["message"]
        assert status(await call("/health", client="10.0.0.3")) == 200
        b.cancel()  # a client gone mid-request
        await asyncio.gather(b, return_exceptions=True)
        assert mw.in_flight == 1
        with pytest.raises(RuntimeError):
            await call("/fail", client="10.0.0.4")
        gate.set()
        assert status(await a) == 200
        assert mw.in_flight == 0 and mw.per_key == {}

    asyncio.run(asyncio.wait_for(scenario(), 10))


# ------------------------------------------------------------------ end to end

KEY1, KEY2 = "key-one", "key-two"
RENDER_LIMIT_S = 3.0


@pytest.fixture(scope="module")
def server():
    if smollm2_gguf_path() is None:
        pytest.skip("the embedded default model is not installed")
    srv = RemoteServer([
        "--max-model-len", "256", "--kv-cache-memory", str(64 << 20),
        "--api-key", KEY1, KEY2, "--max-concurrent-requests", "3", "--max-concurrent-requests-per-key", "2",
        "--trust-request-chat-template", "--max-chat-template-render-seconds", str(RENDER_LIMIT_S),
    ])
    yield srv
    srv.stop()


def _auth(key: str = KEY1) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _plain(server: RemoteServer, key: str = KEY1) -> float:
    start = time.monotonic()
    r = httpx.post(server.url("/v1/completions"), headers=_auth(key), json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_model
def test_e2e_runaway_template_stops_at_its_limit_and_plain_requests_go_on(server):
    _plain(server)  # warm up
    alone = _plain(server)
    answer: dict = {}

    def runaway() -> None:
        start = time.monotonic()
        r = httpx.post(server.url("/v1/chat/completions"), headers=_auth(KEY2), timeout=60,
                       json={"messages": HI, "chat_template": RUNAWAY, "max_tokens": 1})
        answer.update(status=r.status_code, body=r.json(), elapsed=time.monotonic() - start)

    thread = threading.Thread(target=runaway)
    thread.start()
    time.sleep(0.3)
    during = _plain(server)
    thread.join(timeout=30)
    assert answer["status"] == 400 and "--max-chat-template-render-seconds" in answer["body"]["error"]["message"]
    assert RENDER_LIMIT_S <= answer["elapsed"] < RENDER_LIMIT_S + 3.0
    # The plain request was served while the template rendered, not after it.
    # The plain request was served while the template rendered, not after it, and not much slower than
    # alone (the render yields the GIL; without that it took several times as long here).
    assert during < 2 * alone + 1.0, (alone, during)
    # The render thread is free: the server is idle again, not still rendering for nobody.
    before = _cpu_seconds(server.proc.pid)
    time.sleep(1.0)
    assert _cpu_seconds(server.proc.pid) - before < 0.5


@needs_model
@pytest.mark.parametrize("head", [
    b"Content-Length: abc\r\n",
    b"Content-Length: 2\r\nContent-Length: 3\r\n",
    b"Content-Length: -1\r\n",
])
def test_e2e_malformed_content_length_is_error_json(server, head):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head + b"\r\n{}")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_text, _, body = data.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 400"), data
    assert b"content-type: application/json" in head_text.lower()
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"


@needs_model
def test_e2e_in_flight_limits_with_real_streams(server):
    long = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = server.url("/v1/completions")

    def refused(key: str) -> dict:
        r = httpx.post(url, headers=_auth(key), json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        return r.json()["error"]

    def next_event(lines) -> str:
        return next(line for line in lines if line)  # events are separated by blank lines

    def started(stream: httpx.Response):
        # The line iterator is kept: once collected, httpx closes the connection (and the server aborts the stream).
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next_event(lines).startswith("data: {")
        return lines

    with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2, httpx.Client(timeout=60) as c3:
        with c1.stream("POST", url, headers=_auth(KEY1), json=long) as s1, c2.stream("POST", url, headers=_auth(KEY1), json=long) as s2:
            open_streams = [started(s1), started(s2)]
            assert "--max-concurrent-requests-per-key" in refused(KEY1)["message"]  # KEY1 has 2 in flight
            with c3.stream("POST", url, headers=_auth(KEY2), json=long) as s3:
                open_streams.append(started(s3))
                err = refused(KEY2)  # 3 in flight in all
                assert err["type"] == "RateLimitError" and "--max-concurrent-requests)" in err["message"]
                assert all(next_event(lines).startswith("data: {") for lines in open_streams)  # still streaming
    # The streams' clients have gone: their slots are free again.
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(url, headers=_auth(KEY1), json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert "Traceback" not in server.log_text()


# ------------------------------------------------------------------ found by the reliability suite


def test_prompt_lists_are_capped(client):
    err = _error(client.post("/v1/completions", json={"prompt": ["a"] * 1025, "max_tokens": 1}), 400, "prompt")
    assert "--max-prompts-per-request" in err["message"] and "1025" in err["message"]


def test_unknown_field_names_cannot_forge_log_lines(client, caplog):
    with caplog.at_level(logging.WARNING):
        client.post("/v1/completions", json={**COMPLETION, "x\nFORGED-LOG-LINE ERROR y": 1})
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "ignoring unknown fields" in text and "\nFORGED-LOG-LINE" not in text
