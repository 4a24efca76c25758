"""Chat messages to a prompt: text-only message content, the model's chat template."""

from __future__ import annotations

from typing import Any

import jinja2

from tokenmill.entrypoints.openai.errors import BadRequest

_TEXT_PARTS = ("text", "input_text")
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
) -> str:
    """The prompt text from the chat template (the model's, or the request's own). Blocking: run it in a thread."""
    if tokenizer is None:
        raise BadRequest("this model was loaded without a tokenizer, so it cannot chat; use /v1/completions with token ids", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template; use /v1/completions, or send a chat_template with the request", "messages"
        )
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED}
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            documents=documents,
            **kwargs,
        )
    except jinja2.TemplateError as exc:
        raise BadRequest(f"the chat template could not render these messages: {exc}", "messages") from None
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise BadRequest(f"the chat template could not render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise BadRequest("the chat template did not produce text", "messages")
    return text
