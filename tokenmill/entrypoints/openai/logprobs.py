"""tokenmill's logprobs (one dict token_id -> Logprob per token) in the OpenAI shapes.

Completions: {tokens, token_logprobs, top_logprobs, text_offset}; top_logprobs holds the k most likely
tokens plus the sampled one (so up to k + 1 entries, as OpenAI documents).
Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}; top_logprobs holds
exactly the k most likely tokens, most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.outputs import Logprob

from tokenmill.entrypoints.openai.protocol import (
    MIN_LOGPROB,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    CompletionLogProbs,
)


class TokenTexts:
    """A token's text as shown in logprobs: the engine's decoded_token, else the id decoded alone."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def _value(lp: Logprob) -> float:
    v = float(lp.logprob)
    return v if v > MIN_LOGPROB else MIN_LOGPROB  # -inf (and nan) have no JSON form


def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of a step, by rank."""
    ranked = sorted(step.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    out = []
    for token_id, lp in ranked:
        if len(out) >= k:
            break
        if lp.rank is None or lp.rank <= k:
            out.append((token_id, lp))
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob] | None],
    k: int,
    texts: TokenTexts,
    initial_offset: int = 0,
) -> CompletionLogProbs:
    result = CompletionLogProbs()
    offset = initial_offset
    for token_id, step in zip(token_ids, steps):
        lp = step.get(token_id) if step else None
        token = texts(token_id, lp)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if lp is None:  # the first prompt token has no logprob
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_value(lp))
        top = {texts(t, p): _value(p) for t, p in _top(step, k)}
        top.setdefault(token, _value(lp))
        result.top_logprobs.append(top)
    return result


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob] | None],
    k: int,
    texts: TokenTexts,
) -> ChatLogProbs:
    content = []
    for token_id, step in zip(token_ids, steps):
        lp = step.get(token_id) if step else None
        token = texts(token_id, lp)
        top = []
        if step and k:
            for t, p in _top(step, k):
                text = texts(t, p)
                top.append(ChatLogProb(token=text, logprob=_value(p), bytes=_bytes(text)))
        content.append(
            ChatLogProbsContent(
                token=token, logprob=_value(lp) if lp is not None else MIN_LOGPROB, bytes=_bytes(token), top_logprobs=top
            )
        )
    return ChatLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's prompt_logprobs field: [None, {token_id: {logprob, rank, decoded_token}}, ...]."""
    if prompt_logprobs is None:
        return None
    return [
        None if step is None else {
            t: {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in step.items()
        }
        for step in prompt_logprobs
    ]
