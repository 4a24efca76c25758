"""uvicorn's HTTP protocol, answering a request it cannot parse with OpenAI's error JSON.

A malformed request (an invalid or conflicting Content-Length, a broken request line or header) is refused
by uvicorn's HTTP parser before the app sees it, with a plain-text 400. The protocol classes have one hook
for that answer, send_400_response; these subclasses send the same 400 as error JSON, so that every
answer of the server has OpenAI's shape. json_error_http_protocol() picks the parser uvicorn's "auto"
would (httptools if installed, else h11).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.entrypoints.openai.errors import error_body

MESSAGE = "the HTTP request could not be parsed (a malformed request line, header or Content-Length)"


def _json_400() -> bytes:
    return json.dumps(error_body(400, MESSAGE)).encode()


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # msg: uvicorn's plain-text message, logged already
        body = _json_400()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def json_error_http_protocol() -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...)."""
    if importlib.util.find_spec("httptools") is None:
        return JSONErrorH11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = _json_400()
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return JSONErrorHttpToolsProtocol
