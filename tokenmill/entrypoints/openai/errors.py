"""Every failure as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} with its HTTP status.

400 bad parameters / prompt too long / invalid JSON, 401 API key, 404 unknown model or route,
413 body too large, 429 too many requests in flight, 503 queue full or engine dead, 504 request
timeout, 500 anything unexpected: a bug. A 500's body carries the request id and no internals; the
log line with the traceback carries the same id, so a client's report leads to it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from starlette.requests import HTTPConnection
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class OpenAIError(Exception):
    """An error the server answers with its own status and OpenAI error JSON."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None, *, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(self.status_code, HTTPStatus(self.status_code).phrase.replace(" ", "") + "Error")


class BadRequest(OpenAIError):
    status_code = 400


class Unauthorized(OpenAIError):
    status_code = 401


class NotFound(OpenAIError):
    status_code = 404


class RequestTooLarge(OpenAIError):
    status_code = 413


class ServiceUnavailable(OpenAIError):
    status_code = 503


class RequestTimeout(OpenAIError):
    status_code = 504


def error_body(status_code: int, message: str, type: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status_code, "Error"), "param": param, "code": status_code}}


def error_response(status_code: int, message: str, type: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, type, param), status_code=status_code)


_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def guess_param(message: str, known: set[str] | None = None) -> str | None:
    """The parameter a tokenmill ValueError is about: its messages start with the parameter's name."""
    m = _PARAM_RE.match(message)
    if m is None:
        return None
    name = m.group(1)
    if known is not None and name not in known:
        return None
    return name


_SAMPLING_NAMES = {
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs",
}


def classify(exc: BaseException) -> tuple[int, str, str, str | None]:
    """(status, type, message, param) of any exception."""
    if isinstance(exc, OpenAIError):
        return exc.status_code, exc.type, exc.message, exc.param
    if isinstance(exc, EngineOverloadedError):
        return 503, _TYPES[503], str(exc) or "the server is overloaded: too many requests are waiting; try again later", None
    if isinstance(exc, EngineDeadError):
        return 503, _TYPES[503], str(exc) or "the engine has stopped", None
    if isinstance(exc, (InvalidRequestError, ValueError)):
        message = str(exc)
        return 400, _TYPES[400], message, guess_param(message, _SAMPLING_NAMES)
    if isinstance(exc, asyncio.TimeoutError):
        return 504, _TYPES[504], "the request timed out", None
    if isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        return status, _TYPES.get(status, "Error"), _http_exception_message(exc), None
    return 500, _TYPES[500], "internal server error", None


def _http_exception_message(exc: StarletteHTTPException) -> str:
    """FastAPI answers a body that json.loads itself fails on (not a JSONDecodeError) with a vague 400: say why."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return str(exc.detail)
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse"
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause}"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "the request body holds an integer with thousands of digits; integers must fit in 64 bits"
    return str(exc.detail)


def request_id_of(conn: HTTPConnection | None) -> str | None:
    """The id RequestContextMiddleware gave this request (None outside a request)."""
    if conn is None:
        return None
    return conn.scope.get("state", {}).get("request_id")


def error_from_exception(exc: BaseException, request_id: str | None = None) -> dict[str, Any]:
    """The error body for any exception. An unexpected one (a bug) is logged with its traceback under the
    request id; its body gives that id and nothing of the exception, whose text may hold internals."""
    status, type_, message, param = classify(exc)
    if status >= 500 and not isinstance(exc, (OpenAIError, EngineOverloadedError, EngineDeadError, StarletteHTTPException)):
        logger.error("internal server error; request id %s", request_id or "-", exc_info=(type(exc), exc, exc.__traceback__))
        where = f"; request id {request_id}" if request_id else ""
        message = f"internal server error{where} (see the server log)"
    return error_body(status, message, type_, param)


# The pydantic error type of a request body that fails the checks of body_checks.py.
INVALID_BODY = "invalid_request_body"


def validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the top-level field of a pydantic validation error."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == INVALID_BODY:  # found by the walk over the whole body (protocol.py)
        ctx = first.get("ctx") or {}
        return str(ctx.get("message") or first.get("msg")), ctx.get("param")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if not loc:
        if first.get("type") == "missing":
            return "the request body is missing: send a JSON object", None
        return f"the request body is invalid: {first.get('msg')}", None
    param = str(loc[0])
    parts = []
    for err in errors[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, param


def install_exception_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc)
        return error_response(400, message, param=param)

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        body = error_from_exception(exc, request_id_of(request))
        return JSONResponse(body, status_code=body["error"]["code"])

    app.add_exception_handler(RequestValidationError, on_validation)
    for cls in (OpenAIError, InvalidRequestError, ValueError, EngineOverloadedError, EngineDeadError,
                StarletteHTTPException, asyncio.TimeoutError, Exception):
        app.add_exception_handler(cls, on_any)
