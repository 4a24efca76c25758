"""Structured output with xgrammar: compile each constraint once, keep a matcher per request,
and hand the runner one token bitmask per step for the rows it samples.

The engine drives it: ``compile`` at add_request (errors become InvalidRequestError before any
generation), ``bitmask`` after the scheduler has picked the step's chunks, ``accept`` after the
sampled tokens are in. The runner only ever sees a tensor: ``[num sampled rows, ceil(V / 32)]``
int32, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed; rows without a
constraint are all ones, so their logits pass through unchanged.

A preempted request recomputes its KV but never re-samples its tokens, so its matcher stays in
step. A request object that is a copy of another (a forked sequence) gets its own matcher,
replayed over the tokens it already holds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:  # xgrammar takes ~2 s to import: only when a constrained request arrives
    import xgrammar

    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import ScheduledChunk
    from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean_error(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


def _ebnf_string(text: str) -> str:
    """A double-quoted EBNF literal for text (escapes quote, backslash and control characters)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    if any(c == "" for c in choices):
        # An empty alternative is legal in EBNF but makes the grammar accept the empty output.
        alternatives = [_ebnf_string(c) for c in choices if c != ""] + ['""']
    else:
        alternatives = [_ebnf_string(c) for c in dict.fromkeys(choices)]
    return "root ::= " + " | ".join(alternatives)


class _MatcherState:
    """A request's grammar matcher, tied to the request object it was made for."""

    __slots__ = ("owner", "matcher", "num_accepted", "failed")

    def __init__(self, owner: "Request", matcher: "xgrammar.GrammarMatcher") -> None:
        self.owner = owner
        self.matcher = matcher
        self.num_accepted = 0
        self.failed = False


class StructuredOutputManager:
    """Compiles constraints (cached by StructuredOutputsParams.key()) and masks sampling rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs needs a tokenizer, and this model was loaded without one")
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        try:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
            )
        except Exception as exc:  # an unusual tokenizer xgrammar cannot read
            raise InvalidRequestError(f"structured_outputs is not available for this tokenizer: {_clean_error(exc)}") from None
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()  # add_request may come from another thread than step()
        self.num_compiles = 0
        self.num_cache_hits = 0

    # -- compile ----------------------------------------------------------
    def compile(self, params: "StructuredOutputsParams") -> Any:
        """The compiled grammar for params, from the cache or compiled now; InvalidRequestError if it cannot be."""
        key = params.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self.num_cache_hits += 1
                return compiled
            try:
                compiled = self._compile(params)
            except InvalidRequestError:
                raise
            except Exception as exc:
                kind = key[0]
                raise InvalidRequestError(f"invalid structured_outputs.{kind}: {_clean_error(exc)}") from None
            self.num_compiles += 1
            self._cache[key] = compiled
            return compiled

    def _compile(self, params: "StructuredOutputsParams") -> Any:
        compiler = self.compiler
        any_whitespace = not params.disable_any_whitespace
        if params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            if not isinstance(json.loads(schema), dict):
                raise InvalidRequestError("invalid structured_outputs.json: a JSON schema must be a JSON object")
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar(choice_grammar(params.choice))
        if params.grammar is not None:
            return compiler.compile_grammar(params.grammar)
        if params.json_object:
            # Any JSON object. xgrammar's builtin JSON grammar would also allow a top-level array,
            # and json_object (OpenAI's response_format) promises an object.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        raise InvalidRequestError("structured_outputs has no constraint")

    # -- per step ---------------------------------------------------------
    def _state(self, request: "Request") -> _MatcherState:
        state = request.structured_output
        if state is None or state.owner is not request:
            compiled = self.compile(request.sampling_params.structured_outputs)
            state = _MatcherState(request, self._xgr.GrammarMatcher(compiled))
            request.structured_output = state
            for token in request.output_token_ids:  # a forked copy: catch up with its tokens
                self._accept(state, token)
        return state

    def bitmask(self, chunks: list["ScheduledChunk"], requests: dict[str, "Request"]) -> torch.Tensor | None:
        """The step's bitmask over the sampling chunks (in order), or None when none is constrained.

        When a row's grammar allows only tokens that min_tokens bans (EOS at the grammar's end), the
        grammar wins: the ban is lifted for that row, as the output cannot go on inside the grammar.
        """
        sampling = [c for c in chunks if c.sample]
        rows = [
            (row, chunk, requests.get(chunk.request_id))
            for row, chunk in enumerate(sampling)
            if chunk.sampling_params.structured_outputs is not None
        ]
        rows = [(row, chunk, request) for row, chunk, request in rows if request is not None]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(sampling), self.vocab_size)  # all ones: everything allowed
        for row, chunk, request in rows:
            state = self._state(request)
            if state.failed or state.matcher.is_terminated():
                continue
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if chunk.banned_token_ids and not self._allows_other_than(bitmask[row], chunk.banned_token_ids):
                chunk.banned_token_ids = ()
        return bitmask

    def _allows_other_than(self, words: torch.Tensor, banned: tuple[int, ...]) -> bool:
        bits = words.numpy().view(np.uint32).copy()
        for token in banned:
            if 0 <= token < self.vocab_size:
                bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        return bool(bits.any())

    def accept(self, request: "Request", token_id: int) -> bool:
        """Advance the request's matcher by its new token; True once the grammar has terminated (EOS taken)."""
        state = self._state(request)
        if state.num_accepted < request.num_output_tokens:
            self._accept(state, token_id)
        return state.matcher.is_terminated()

    def _accept(self, state: _MatcherState, token_id: int) -> None:
        state.num_accepted += 1
        if state.failed or state.matcher.is_terminated():
            return
        if not state.matcher.accept_token(token_id):
            # Cannot happen when the mask was applied; keep going unconstrained rather than crash the step.
            logger.error("request %s: token %d is not allowed by its grammar", state.owner.request_id, token_id)
            state.failed = True
