"""Engine-side sampling controls: token-id checks and bad words at add_request, logprobs per step.

The sampler works on token ids; here the user's parameters become token ids (bad words are
tokenized as vLLM does) and the runner's logprob numbers become vLLM's output shapes:
``CompletionOutput.logprobs`` is one ``dict[token_id, Logprob]`` per generated token (the
sampled token plus the top-k), ``RequestOutput.prompt_logprobs`` is ``[None]`` plus one such
dict per later prompt token. Token texts are decoded once per distinct id (one batched
tokenizer call per step for the ids not seen before) and cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.request import Request
    from tokenmill.engine.messages import ScheduledChunk
    from tokenmill.engine.messages import ModelRunnerOutput, PositionLogprobs


def check_token_controls(params: SamplingParams, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Refuse token ids outside the vocabulary; return bad_words as token-id sequences."""
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    # Stop token ids are banned from sampling while min_tokens are not out yet: an id the model
    # cannot produce would index past the logits inside the step.
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer; this model was loaded without one")
    words = bad_words_token_ids(tokenizer, params.bad_words)
    bad = sorted({t for word in words for t in word if not 0 <= t < vocab_size})
    if bad:
        raise InvalidRequestError(
            f"bad_words tokenize to token ids {bad[:5]} outside the model's vocabulary [0, {vocab_size})"
        )
    return words


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as it is and with a leading space (to ban it both at
    the start of the text and inside it); the spaced form only when it is a different word of the same length."""
    out: list[list[int]] = []
    for word in bad_words:
        plain: list[int] | None = None
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                continue
            if not prefix:
                plain = ids
                out.append(ids)
            elif plain is None or (ids[0] != plain[0] and len(ids) == len(plain)):
                out.append(ids)
    return out


class LogprobsProcessor:
    """Stores each step's logprobs on the requests, as vLLM's dicts of Logprob."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._limit = len(tokenizer) if tokenizer is not None else 0
        self._texts: dict[int, str] = {}

    def record(self, chunks: list["ScheduledChunk"], result: "ModelRunnerOutput", updated: list["Request"], requests: dict[str, "Request"]) -> None:
        """Store one step's logprobs as vLLM's dicts. `updated`: the requests that got tokens this step
        (num_new_output_tokens of them: the scheduler's update cut a run at a stop, and summed the
        cumulative logprob); `requests`: the scheduler's live requests (for prompt chunks that sampled nothing)."""
        got_token = {r.request_id: r for r in updated}
        sampled: list[tuple["Request", "PositionLogprobs"]] = []
        prompt: list[tuple["Request", int, list["PositionLogprobs"]]] = []
        for i, chunk in enumerate(chunks):
            request = got_token.get(chunk.request_id)
            if request is not None and result.logprobs[i] is not None:
                sampled.extend((request, pos) for pos in result.logprobs[i][: request.num_new_output_tokens])
            entry = result.prompt_logprobs[i]
            if entry is not None:
                request = request or requests.get(chunk.request_id)
                if request is None or (request.is_finished and request.request_id not in got_token):
                    continue  # aborted while the step ran
                if not request.prompt_logprobs:
                    request.prompt_logprobs.append(None)  # the first prompt token has no logprob
                # Positions already stored (a preempted request computes its prompt again) are skipped.
                skip = len(request.prompt_logprobs) - entry.first_index
                if 0 <= skip < len(entry.positions):
                    prompt.append((request, request.sampling_params.prompt_logprobs, entry.positions[skip:]))
        if not sampled and not prompt:
            return
        texts = self._decode(
            [t for _, pos in sampled for t in pos.token_ids]
            + [t for _, _, positions in prompt for pos in positions for t in pos.token_ids]
        )
        for request, pos in sampled:
            request.output_logprobs.append(_logprob_dict(pos, request.sampling_params.logprobs, texts))
        for request, k, positions in prompt:
            request.prompt_logprobs.extend(_logprob_dict(pos, k, texts) for pos in positions)

    def _decode(self, token_ids: list[int]) -> dict[int, str] | None:
        """Each id's text as vLLM shows it (the id decoded alone); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        missing = sorted({t for t in token_ids if t not in self._texts})
        if missing:
            known = [t for t in missing if t < self._limit]
            for t, text in zip(known, self.tokenizer.batch_decode([[t] for t in known])):
                self._texts[t] = text
            for t in missing:  # padded vocabulary entries beyond the tokenizer
                self._texts.setdefault(t, "")
        return self._texts


def _logprob_dict(pos: "PositionLogprobs", k: int, texts: dict[int, str] | None) -> dict[int, Logprob]:
    """The actual token with its rank, then the k most likely tokens with ranks 1..k (vLLM's dict)."""
    first = pos.token_ids[0]
    out = {first: Logprob(pos.logprobs[0], pos.rank, texts[first] if texts is not None else None)}
    for rank, (token, value) in enumerate(zip(pos.token_ids[1 : k + 1], pos.logprobs[1 : k + 1]), start=1):
        if token not in out:
            out[token] = Logprob(value, rank, texts[token] if texts is not None else None)
    return out
