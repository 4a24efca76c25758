"""Pure ASGI middlewares (they leave streaming and disconnect messages alone):

- RequestContextMiddleware: a request id per request (the client's X-Request-Id, or a new one), sent
  back in X-Request-Id, and one structured access-log line per request when its response has ended.
- AuthMiddleware: `Authorization: Bearer <api key>` (any of the server's keys) on every route but
  /health, /metrics, /version.
- ConcurrencyLimitMiddleware: requests in flight over the server's limit, overall or per API key (per
  client address without keys), get a 429 with Retry-After.
- BodyLimitMiddleware: a request body over the limit is a 413 (Content-Length checked first, then the
  bytes actually received).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import error_body

access_logger = logging.getLogger("tokenmill.access")

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


async def _send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, access_log: bool = True) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        request_id = request_id or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 0
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            status = status or 500
            raise
        finally:
            if self.access_log:
                access_logger.info(
                    "request_id=%s method=%s path=%s status=%s prompt_tokens=%s completion_tokens=%s duration_ms=%.1f client=%s",
                    request_id, scope.get("method"), scope.get("path"), status or 499,
                    state.get("prompt_tokens", "-"), state.get("completion_tokens", "-"),
                    (time.perf_counter() - start) * 1000.0,
                    "%s:%s" % tuple(scope["client"]) if scope.get("client") else "-",
                )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        # Every key is compared (no early exit), so the time taken tells nothing about which one nearly matched.
        matches = [secrets.compare_digest(given, expected) for expected in self.expected]
        if not any(matches):
            message = "Missing API key: send it as 'Authorization: Bearer <key>'" if not given else "Incorrect API key"
            await _send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class ConcurrencyLimitMiddleware:
    """At most `max_total` requests in flight, and at most `max_per_key` per API key (per client address when
    the server has no keys). A request counts from its arrival to the end of its response, a stream until
    its last event or its client's disconnect, whatever the outcome. The counts live on the event loop's
    thread only, so plain integers are enough. /health, /metrics and the like are never refused: a load
    balancer must still see a busy server as alive."""

    def __init__(self, app: ASGIApp, max_total: int | None = None, max_per_key: int | None = None,
                 by_api_key: bool = False, retry_after_s: int = 1) -> None:
        self.app = app
        self.max_total = max_total
        self.max_per_key = max_per_key
        self.by_api_key = by_api_key  # AuthMiddleware, outside this one, has checked the key
        self.retry_after = str(retry_after_s).encode()
        self.in_flight = 0
        self.per_key: dict[str, int] = {}  # only keys with requests in flight: it cannot grow without bound

    def _key(self, scope: Scope) -> str:
        if self.by_api_key:
            return "key:" + (_header(scope, b"authorization") or b"").decode("latin-1")
        client = scope.get("client")
        return "addr:" + (client[0] if client else "-")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        key = self._key(scope) if self.max_per_key is not None else None
        if self.max_total is not None and self.in_flight >= self.max_total:
            await self._refuse(send, f"the server is at its limit of {self.max_total} requests in flight "
                                     "(its --max-concurrent-requests); retry later")
            return
        if key is not None and self.per_key.get(key, 0) >= self.max_per_key:
            who = "this API key" if self.by_api_key else "this client address"
            await self._refuse(send, f"{who} is at its limit of {self.max_per_key} requests in flight "
                                     "(the server's --max-concurrent-requests-per-key); retry later")
            return
        self.in_flight += 1
        if key is not None:
            self.per_key[key] = self.per_key.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if key is not None:
                left = self.per_key[key] - 1
                if left:
                    self.per_key[key] = left
                else:
                    del self.per_key[key]

    async def _refuse(self, send: Send, message: str) -> None:
        await _send_error(send, 429, message, [(b"retry-after", self.retry_after)])


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout  # a body that stops arriving (a short one, a slow client) gets 408

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, 400, "invalid Content-Length header")
                    return
                if declared > self.max_bytes:
                    await self._too_large(send, declared)
                    return
        # Read the whole body here (it is small), counting bytes; replay it to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                await _send_error(send, 408, f"the request body did not arrive within {self.read_timeout:g} s "
                                             "(the server's --request-body-timeout)")
                return
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(send, size)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send, 413, f"the request body ({size} bytes or more) is larger than the server's limit of {self.max_bytes} bytes"
        )
