"""Pure ASGI middlewares (they leave streaming and disconnect messages alone):

- RequestContextMiddleware: a request id per request (the client's X-Request-Id, or a new one), sent
  back in X-Request-Id, and one structured access-log line per request when its response has ended.
- AuthMiddleware: `Authorization: Bearer <api key>` on every route but /health, /metrics, /version.
- BodyLimitMiddleware: a request body over the limit is a 413 (Content-Length checked first, then the
  bytes actually received).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid

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


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not secrets.compare_digest(given, self.expected):
            message = "Missing API key: send it as 'Authorization: Bearer <key>'" if not given else "Incorrect API key"
            await _send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
            message = await receive()
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
