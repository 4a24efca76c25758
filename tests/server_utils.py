"""Run `tokenmill serve` in a subprocess on 127.0.0.1 for end-to-end tests, as a user would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m tokenmill.entrypoints.cli serve <args>` on a free port; its log goes to a file (never a pipe
    that could fill up and block the server)."""

    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.host = "127.0.0.1"
        self.log = tempfile.NamedTemporaryFile(prefix="tokenmill-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--host", self.host, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(startup_timeout)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log_text()[-4000:]}")

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped, values summed over label sets) -> value."""
        text = httpx.get(self.url("/metrics"), timeout=10.0).text
        return parse_metrics(text)

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is in use; return the last sample."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["vllm:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM, up to `grace` seconds for a graceful exit, then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


RESPONSES_TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def sse_events(lines, responses: bool = False) -> list:
    """The `data:` payloads of an SSE body (an iterable of lines), as JSON or the string "[DONE]".

    Streams of completions and chat are `data:` lines only (their callers check that [DONE] ends them).
    responses=True reads a Responses API stream (POST /v1/responses) in OpenAI's framing, and checks it:
    every event an `event: <type>` line, then a `data:` line whose JSON has that type; no [DONE]; the
    last event, and only it, response.completed, response.incomplete or response.failed."""
    import json

    events = []
    named = None  # a Responses event's type, from its `event:` line
    for line in lines:
        if not line:
            continue
        if responses and named is None and line.startswith("event: "):
            named = line[len("event: "):]
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if not responses:
            events.append(data if data == "[DONE]" else json.loads(data))
            continue
        assert named is not None, f"a data line without its event line: {line[:200]}"
        assert data != "[DONE]", "a Responses stream ends with its last event, not [DONE]"
        payload = json.loads(data)
        assert isinstance(payload, dict) and payload.get("type") == named, f"event {named!r} with data {data[:200]}"
        events.append(payload)
        named = None
    if responses:
        assert named is None, f"an event line without data: {named!r}"
        types = [e["type"] for e in events]
        assert types and types[-1] in RESPONSES_TERMINAL_EVENTS, f"the stream does not end with a terminal event: {types[-3:]}"
        assert not set(types[:-1]) & set(RESPONSES_TERMINAL_EVENTS), f"a terminal event before the last one: {types}"
    return events
