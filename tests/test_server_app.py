"""The server app over a scripted fake engine (no model, in process): failure paths that a real engine
rarely shows (an engine that dies, a step that fails mid-stream, a bug) still answer with OpenAI error
JSON, and the server keeps serving; and the request-to-SamplingParams mapping of every parameter."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tokenmill.engine.engine import EngineStats  # noqa: E402
from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app  # noqa: E402
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from tokenmill.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError  # noqa: E402
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402

from chat_fakes import stamp_step  # noqa: E402
from server_utils import parse_metrics, sse_events  # noqa: E402


class FakeEngine:
    """Token ids only (no tokenizer). Each generated token is 7; `mode` scripts a failure."""

    model_name = "fake"
    tokenizer = None
    max_model_len = 64
    vocab_size = 100

    def __init__(self) -> None:
        self.mode = "ok"
        self.errored = False
        self.is_running = True
        self.closed: list[str] = []

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)

    async def generate(self, prompt, params, request_id):
        ids = list(prompt["prompt_token_ids"])
        mode = self.mode
        if mode == "dead":
            raise EngineDeadError("the engine loop failed: RuntimeError('boom')")
        if mode == "overloaded":
            raise EngineOverloadedError("the server is overloaded: 3 requests are already waiting")
        if mode == "invalid":
            raise InvalidRequestError("token ids [999] are outside the vocabulary [0, 100)")
        if mode == "bug":
            raise RuntimeError("a bug in the engine")
        metrics = RequestMetrics(arrival_time=time.monotonic())
        try:
            for step in range(1, params.max_tokens + 1):
                if mode == "midstream" and step == 3:
                    raise RuntimeError("the engine step failed: CUDA error")
                last = step == params.max_tokens
                reason = ("abort" if mode == "abort" else "length") if last else None
                stamp_step(metrics, last)
                outputs = [CompletionOutput(index=i, text="x" * step, token_ids=[7] * step, finish_reason=reason)
                           for i in range(params.n)]
                yield RequestOutput(request_id, None, ids, outputs, finished=last, metrics=metrics)
        finally:
            self.closed.append(request_id)

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture()
def engine():
    return FakeEngine()


@pytest.fixture()
def client(engine):
    app = build_app(engine, ServerSettings(served_model_names=["fake"]), manage_engine=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


BODY = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4}


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_ok_and_stream(client):
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "xxxx" and r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    r = client.post("/v1/completions", json={**BODY, "stream": True, "n": 2})
    events = sse_events(r.text.split("\n"))
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: "xxxx", 1: "xxxx"}


@pytest.mark.parametrize("mode, status, kind", [
    ("dead", 503, "ServiceUnavailableError"),
    ("overloaded", 503, "ServiceUnavailableError"),
    ("invalid", 400, "BadRequestError"),
    ("bug", 500, "InternalServerError"),
    ("abort", 503, "ServiceUnavailableError"),
])
def test_engine_failures_are_error_json_and_server_keeps_serving(client, engine, mode, status, kind):
    engine.mode = mode
    assert _error(client.post("/v1/completions", json=BODY), status)["type"] == kind
    r = client.post("/v1/completions", json={**BODY, "stream": True})
    if mode == "abort":  # the last output says aborted: the stream has begun, so it ends with an error event
        assert sse_events(r.text.split("\n"))[-2]["error"]["type"] == kind
    else:  # a failure before a stream's first output is still an HTTP error, not a broken stream
        assert _error(r, status)["type"] == kind
    engine.mode = "ok"
    assert client.post("/v1/completions", json=BODY).status_code == 200


def test_failure_mid_stream_is_an_error_event(client, engine):
    engine.mode = "midstream"
    r = client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text.split("\n"))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500 and "request id" in events[-2]["error"]["message"]
    assert "CUDA error" not in events[-2]["error"]["message"]  # internal details go to the log only
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["x", "x"]
    assert engine.closed  # the engine request was closed (aborted)
    engine.mode = "ok"
    assert client.post("/v1/completions", json=BODY).status_code == 200


def test_dead_engine_fails_health(client, engine):
    assert client.get("/health").status_code == 200
    engine.errored = True
    assert _error(client.get("/health"), 503)["type"] == "ServiceUnavailableError"


def test_no_tokenizer_errors(client):
    assert "tokenizer" in _error(client.post("/v1/completions", json={**BODY, "prompt": "text"}), 400)["message"]
    assert "tokenizer" in _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}), 400)["message"]
    assert _error(client.post("/tokenize", json={"prompt": "Hi"}), 400)


def test_metrics_observed(client):
    client.post("/v1/completions", json=BODY)
    m = parse_metrics(client.get("/metrics").text)
    assert m["vllm:generation_tokens_total"] == 4 and m["vllm:prompt_tokens_total"] == 3
    assert m["vllm:inter_token_latency_seconds_count"] == 3 and m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:request_success_total"] == 1


def test_completion_request_maps_every_parameter():
    req = CompletionRequest(
        prompt="hi", max_tokens=8, temperature=0.5, top_p=0.9, n=2, best_of=3, stop="x", seed=1, presence_penalty=0.1,
        frequency_penalty=0.2, logit_bias={"5": 10}, logprobs=2, echo=True, top_k=4, min_p=0.05, repetition_penalty=1.1,
        stop_token_ids=[3], include_stop_str_in_output=True, ignore_eos=True, min_tokens=2, skip_special_tokens=False,
        spaces_between_special_tokens=False, allowed_token_ids=[1, 2, 5], bad_words=["no"], prompt_logprobs=1,
        guided_regex="[a-z]+",
    )
    p = req.to_sampling_params(8)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.best_of, p.stop, p.seed) == (8, 0.5, 0.9, 2, 3, ["x"], 1)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.logprobs) == (0.1, 0.2, {5: 10.0}, 2)
    assert p.prompt_logprobs == 2  # echo with logprobs: the prompt's tokens get logprobs too
    assert (p.top_k, p.min_p, p.repetition_penalty, p.stop_token_ids, p.include_stop_str_in_output) == (4, 0.05, 1.1, [3], True)
    assert (p.ignore_eos, p.min_tokens, p.skip_special_tokens, p.spaces_between_special_tokens) == (True, 2, False, False)
    assert (p.allowed_token_ids, p.bad_words) == ([1, 2, 5], ["no"])
    assert p.structured_outputs == StructuredOutputsParams(regex="[a-z]+")


def test_chat_request_maps_logprobs_and_response_format():
    schema = {"type": "object"}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3,
                                max_completion_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert req.requested_max_tokens == 5
    p = req.to_sampling_params(5)
    assert p.logprobs == 3 and p.structured_outputs == StructuredOutputsParams(json=schema)
    assert p.temperature == 1.0 and p.max_tokens == 5
    p = ChatCompletionRequest(messages=[], response_format={"type": "json_object"}).to_sampling_params(None)
    assert p.logprobs is None and p.structured_outputs == StructuredOutputsParams(json_object=True)
    p = ChatCompletionRequest(messages=[], structured_outputs={"choice": ["a", "b"]}).to_sampling_params(None)
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
