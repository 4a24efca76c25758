"""`tokenmill bench serve`: a streaming client for any OpenAI-compatible server.

Requests go out on vLLM's arrival schedule (metrics.arrival_times: Poisson at --request-rate, or
all at once), at most --max-concurrency in flight, each a streaming POST to /v1/completions or
/v1/chat/completions with temperature 0, max_tokens, ignore_eos (a vLLM extension that our server,
vLLM and llama.cpp's server accept) and stream_options.include_usage. The client reads the server-
sent events (`data: {...}` lines up to `data: [DONE]`):

- a content chunk is a chunk whose first choice carries generated text: `text` for completions,
  `delta.content` (or reasoning content) for chat, empty text included (a token whose characters
  are incomplete). A chat chunk that only announces the role is not one, nor is a chunk with no
  text that only carries the finish_reason (llama.cpp ends streams so) unless nothing came before
  it (a server that holds back undecodable text may send only that chunk);
- TTFT is the time from sending the request to its first content chunk; ITL are the gaps between
  consecutive content chunks; end-to-end latency runs to the last content chunk (vLLM's rules);
- output tokens are the server's usage.completion_tokens when it sends usage, else the number of
  content chunks (one token per chunk, which holds for the servers above);
- a request that fails (connection error, HTTP error, an error event, no content) is counted as
  failed and its error kept; it never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import aiohttp
from tqdm.auto import tqdm

from tokenmill.bench.metrics import RequestResult, arrival_times
from tokenmill.errors import TokenmillError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ServeRequest:
    """What is sent: the prompt (token ids or text) and how many tokens to ask for."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def join_url(base_url: str, path: str) -> str:
    """base_url + path, without a doubled slash or a doubled /v1 (base URLs are often given with /v1)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def build_payload(endpoint: str, model: str, request: ServeRequest, ignore_eos: bool, extra: dict | None = None) -> dict:
    payload: dict = {"model": model}
    if is_chat(endpoint):
        if not isinstance(request.prompt, str):
            raise ValueError("chat requests need text prompts (--prompt-format text)")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update(
        {
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra or {})
    return payload


FINISH_ONLY = object()  # chunk_content's answer for a chunk with no text that only ends the choice


def chunk_content(chunk: dict, chat: bool):
    """The generated text a streamed chunk carries; None if it is not a content chunk; FINISH_ONLY for a
    chunk with no text that only carries the finish_reason (a content chunk only if nothing came before:
    a server that holds back text it cannot decode may send nothing else)."""
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    finished = choice.get("finish_reason") is not None
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if text or reasoning:
            return (text or "") + (reasoning or "")
        if finished:
            return FINISH_ONLY
        if text == "" and "role" not in delta:
            return ""  # a token whose text is held back (an incomplete character)
        return None
    text = choice.get("text")
    if text is None:
        return FINISH_ONLY if finished else None
    if text == "" and finished:
        return FINISH_ONLY
    return text


class _EventReader:
    """One stream's server-sent events as they arrive: times the content chunks and keeps their text and the
    usage, by the rules of the module docstring. line() takes one line; True when the stream is over
    ([DONE], or an error event, which sets result.error)."""

    def __init__(self, result: RequestResult, chat: bool, start: float) -> None:
        self.result, self.chat = result, chat
        self.start = self.last = start
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.text_parts: list[str] = []

    def line(self, raw: bytes) -> bool:
        if not raw.startswith(b"data:"):
            return False  # blank separators, SSE comments (keep-alives), event:/id: fields
        data = raw[len(b"data:") :].strip()
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return False
        if chunk.get("error"):
            error = chunk["error"]
            self.result.error = f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
            return True
        text = chunk_content(chunk, self.chat)
        if text is FINISH_ONLY:
            text = "" if self.chunks == 0 else None
        if text is not None:
            now = time.perf_counter()
            if self.chunks == 0:
                self.result.ttft = now - self.start
            else:
                self.result.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.text_parts.append(text)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        return False


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """One streaming request, timed as the module docstring says. Never raises for a failed request."""
    result = RequestResult(prompt_len=prompt_len)
    reader = _EventReader(result, "messages" in payload, time.perf_counter())
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode("utf-8", errors="replace").strip()
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            # Whatever bytes have arrived are split into lines at once (bytes.split, in C), as vLLM's client
            # does: a streamed token then costs the client little more than its JSON (httpx's line iterator
            # took ~3x the CPU), which matters as the client shares the cores with the server it measures.
            pending = b""
            async for data in response.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                if any(reader.line(raw) for raw in lines):
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    except ValueError as exc:  # json.JSONDecodeError, or an event that is not UTF-8
        result.error = f"a streamed event is not JSON: {exc}"
        return result
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, never the end of the run
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if result.error:  # an error event
        return result
    result.generated_text = "".join(reader.text_parts)
    if reader.chunks == 0:
        result.error = "the stream held no content chunk, so there is no time to first token"
        return result
    result.success = True
    result.latency = reader.last - reader.start
    result.output_tokens = reader.usage_tokens if reader.usage_tokens is not None else reader.chunks
    return result


def make_client(timeout: float | None) -> aiohttp.ClientSession:
    # No connection limit: the benchmark's own --max-concurrency decides how many requests are in flight
    # (aiohttp's default of 100 connections would queue the rest inside the client, hiding it from TTFT).
    # A proxy from the environment must not sit between the client and a local server (aiohttp's
    # trust_env is off by default).
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout, connect=30.0),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at GET /v1/models."""
    url = join_url(base_url, "/v1/models")
    try:
        async with session.get(url) as response:
            if response.status != 200:
                raise TokenmillError(f"GET {url} answered HTTP {response.status}; give --model")
            body = await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise TokenmillError(f"cannot reach the server at {url}: {exc or type(exc).__name__}") from None
    try:
        models = json.loads(body)["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise TokenmillError(f"GET {url} listed no model; give --model") from None


async def run_serve(
    base_url: str,
    endpoint: str,
    model: str | None,
    requests: list[ServeRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    extra_body: dict | None = None,
    probe: ServeRequest | None = None,
    timeout: float | None = None,
    use_tqdm: bool = True,
) -> tuple[str, list[RequestResult], float]:
    """Send every request on the arrival schedule; (model name, per-request results in request order, duration)."""
    if not requests:
        raise ValueError("no requests to send")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    url = join_url(base_url, endpoint)
    async with make_client(timeout) as client:
        if model is None:
            model = await resolve_model(client, base_url)
        if probe is not None:  # one short request first: a wrong URL, model or endpoint fails here, once
            result = await send_request(client, url, build_payload(endpoint, model, probe, ignore_eos, extra_body), probe.prompt_len)
            if not result.success:
                raise TokenmillError(f"the test request to {url} failed: {result.error}")
        print(
            f"Traffic request rate: {request_rate}; burstiness: {burstiness}"
            f"{' (Poisson process)' if burstiness == 1.0 else ''}; max concurrency: {max_concurrency}",
            file=sys.stderr,
        )
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="Serving", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()

        async def one(i: int, request: ServeRequest) -> RequestResult:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = build_payload(endpoint, model, request, ignore_eos, extra_body)
            if semaphore is None:
                result = await send_request(client, url, payload, request.prompt_len)
            else:
                async with semaphore:
                    result = await send_request(client, url, payload, request.prompt_len)
            result.start_time = offsets[i]
            bar.update(1)
            return result

        try:
            results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return model, list(results), duration
