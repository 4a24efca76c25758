"""Server-Sent Events and client disconnects.

SSEResponse streams `data: {...}` events and watches the connection: when the client goes away the
stream is cancelled at once (not at the next write) and its generator is closed, which aborts the
engine requests behind it. `run_until_disconnect` does the same for a non-streaming handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import error_body

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# Status logged for a request whose client went away before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def sse(payload: Any) -> str:
    """One event: a pydantic model, a dict, or pre-serialized JSON text."""
    if hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json()
    elif isinstance(payload, str):
        data = payload
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], status_code: int = 200, headers: dict[str, str] | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, status_code=status_code, headers=headers, media_type=self.media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        cancelled = False
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The server cancels what is still running when its graceful-shutdown time is up.
            cancelled = True
        finally:
            stream_was_done = stream.done()
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            logger.error("a stream failed", exc_info=(type(exc), exc, exc.__traceback__))
        if cancelled and not stream_was_done:
            # The request is aborted (its generator is closed): end the stream properly with an error event.
            logger.info("stream ended by the server shutting down")
            tail = self.shutdown_tail("the server is shutting down: the request was aborted")
            try:
                if not self._started:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass
        elif not stream_was_done:
            logger.info("client disconnected during a stream: request aborted")

    _started = False

    def shutdown_tail(self, message: str) -> str:
        """What ends a stream cut short by the server shutting down (a 503 error event, then [DONE]);
        the Responses API ends its streams its own way."""
        return sse(error_body(503, message)) + DONE

    async def _stream(self, send: Send) -> None:
        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                self._started = True
            await send(message)

        try:
            await self.stream_response(tracked)
        except OSError:  # the connection broke while writing
            logger.info("client disconnected during a stream")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a handler; if the client disconnects first, cancel it (aborting its engine requests)."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # The server cancels what is still running when its graceful-shutdown time is up.
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return JSONResponse(error_body(503, "the server is shutting down: the request was aborted"), status_code=503)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        logger.info("client disconnected before the response: request cancelled")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return work.result()
