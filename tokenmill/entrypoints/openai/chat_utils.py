"""Chat messages to a prompt: text-only message content, the model's chat template (rendered within
time and size limits; a request's own template only where the operator trusts it)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import jinja2

from tokenmill.entrypoints.openai.errors import BadRequest
from tokenmill.entrypoints.openai.render_limits import RenderCancelled, RenderLimitExceeded, RenderLimits, run_limited

if TYPE_CHECKING:
    from tokenmill.entrypoints.openai.template_isolation import TemplateIsolation

_TEXT_PARTS = ("text", "input_text")
# What the model's own template raises on messages it cannot render (raise_exception, a missing key, an
# unexpected type, a range over the sandbox's limit): the request's fault, a 400.
_RENDER_INPUT_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, ArithmeticError)
# Arguments of apply_chat_template that chat_template_kwargs must not override.
_RESERVED = {"conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
             "add_generation_prompt", "continue_final_message", "chat_template", "tools", "documents"}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with their content as one string (a list of text parts is joined with newlines, as vLLM does)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise BadRequest(f"messages[{i}].content: a text part needs a string 'text'", "messages")
                    texts.append(text)
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BadRequest(
                        f"messages[{i}].content: parts of type {kind!r} are not supported; this server takes text only",
                        "messages",
                    )
            message = {**message, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append(message)
    return out


def check_request_template(chat_template: str | None, trusted: bool) -> None:
    """A template sent with a request is code the server would run: refused unless the operator trusts
    it (vLLM's fix for CVE-2025-61620)."""
    if chat_template is not None and not trusted:
        raise BadRequest(
            "chat_template in a request is refused: the server runs only its model's own chat template "
            "unless it is started with --trust-request-chat-template",
            "chat_template",
        )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    limits: RenderLimits | None = None,
    stop: threading.Event | None = None,
) -> str:
    """The prompt text from the chat template (the model's, or the request's own). Blocking: run it in a
    thread (render_chat_async). Within `limits`, and stopped early once `stop` is set."""
    if tokenizer is None:
        raise BadRequest("this model was loaded without a tokenizer, so it cannot chat; use /v1/completions with token ids", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template; use /v1/completions, or send a chat_template with the request "
            "(where the server trusts request templates: --trust-request-chat-template)", "messages"
        )
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED}
    limits = limits or RenderLimits(max_seconds=None, max_output_chars=None)

    def render() -> Any:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            documents=documents,
            **kwargs,
        )

    try:
        text = run_limited(render, limits, stop)
    except RenderLimitExceeded as exc:
        raise BadRequest(str(exc), "chat_template" if chat_template is not None else "messages") from None
    except (RenderCancelled, MemoryError):  # a MemoryError is the server's, or a template child's limit
        raise
    except Exception as exc:  # noqa: BLE001 - sorted below: the request's fault, or a bug
        # A template sent with the request is the request's own code: whatever it raises (1/0, a
        # recursive macro, a range over the sandbox's limit, a huge allocation) is a 400. The model's
        # template fails on messages it cannot take in these ways; anything else from it is a bug.
        if chat_template is None and not isinstance(exc, _RENDER_INPUT_ERRORS):
            raise
        param = "chat_template" if chat_template is not None else "messages"
        raise BadRequest(f"the chat template could not render these messages: {exc or type(exc).__name__}", param) from None
    if not isinstance(text, str):
        raise BadRequest("the chat template did not produce text", "messages")
    if limits.max_output_chars is not None and len(text) > limits.max_output_chars:  # a template that is not Jinja's
        raise BadRequest(
            f"the chat template wrote more than {limits.max_output_chars} characters "
            "(the server's --max-chat-template-output-chars)",
            "chat_template" if chat_template is not None else "messages",
        )
    return text


async def render_chat_async(tokenizer: Any, messages: list[dict[str, Any]], *,
                            isolation: "TemplateIsolation | None" = None, **kwargs: Any) -> str:
    """render_chat on a worker thread; a template sent with the request in one of `isolation`'s child
    processes, where there is one. If the caller is cancelled (its client left), the render is told to
    stop at its next check, so the thread is freed instead of rendering for nobody."""
    stop = threading.Event()
    try:
        if isolation is not None and kwargs.get("chat_template") is not None:
            kwargs.pop("limits", None)  # the isolation renders within its own
            return await asyncio.to_thread(isolation.render, messages, stop=stop, **kwargs)
        return await asyncio.to_thread(render_chat, tokenizer, messages, stop=stop, **kwargs)
    finally:
        stop.set()
