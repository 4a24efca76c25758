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
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.engine.grammar_worker import (
    CompileJob,
    GrammarCompileError,
    GrammarCompileTimeout,
    GrammarCompileWorker,
    GrammarWorkerCrashed,
)
from tokenmill.errors import EngineOverloadedError, InvalidRequestError, TokenmillError

if TYPE_CHECKING:  # xgrammar takes ~2 s to import: only when a constrained request arrives
    import xgrammar

    from tokenmill.engine.request import Request
    from tokenmill.engine.messages import ScheduledChunk
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


def compile_job(params: "StructuredOutputsParams") -> CompileJob:
    """What the grammar compiler gets for a constraint (every kind becomes a JSON schema, a regex or EBNF)."""
    any_whitespace = not params.disable_any_whitespace
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        if not isinstance(json.loads(schema), dict):
            raise InvalidRequestError("invalid structured_outputs.json: a JSON schema must be a JSON object")
        return CompileJob("json", schema, any_whitespace)
    if params.regex is not None:
        return CompileJob("regex", params.regex)
    if params.choice is not None:
        return CompileJob("grammar", choice_grammar(params.choice))
    if params.grammar is not None:
        return CompileJob("grammar", params.grammar)
    if params.json_object:
        # Any JSON object. xgrammar's builtin JSON grammar would also allow a top-level array,
        # and json_object (OpenAI's response_format) promises an object.
        return CompileJob("json", '{"type": "object"}', any_whitespace, strict_mode=False)
    raise InvalidRequestError("structured_outputs has no constraint")


class StructuredOutputManager:
    """Compiles constraints (cached by StructuredOutputsParams.key()) and masks sampling rows.

    Compiles run in a child process (grammar_worker.py), one at a time, each bounded by
    compile_timeout seconds (the wait for the compiler counts too); a request whose constraint
    is being compiled by another request waits for that compile instead of repeating it. The
    cache of compiled grammars is an LRU bounded in bytes, and constraints that timed out are
    remembered (a bounded set), so a resent slow schema is refused at once.
    """

    _MAX_TIMED_OUT_KEYS = 1024

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 compile_timeout: float | None = 10.0, cache_bytes: int = 256 << 20) -> None:
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs needs a tokenizer, and this model was loaded without one")
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        try:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
            )
        except Exception as exc:  # an unusual tokenizer xgrammar cannot read
            raise InvalidRequestError(f"structured_outputs is not available for this tokenizer: {_clean_error(exc)}") from None
        self.worker = GrammarCompileWorker(self.tokenizer_info.serialize_json())
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cached_bytes = 0
        self._timed_out: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()  # make_request runs on several worker threads at once
        self.num_compiles = 0
        self.num_cache_hits = 0

    def close(self) -> None:
        self.worker.close()

    # -- compile ----------------------------------------------------------
    def compile(self, params: "StructuredOutputsParams") -> Any:
        """The compiled grammar for params, from the cache or compiled now; InvalidRequestError if it cannot be."""
        key = params.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
            if key in self._timed_out:
                raise self._timeout_error(key[0])
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = Future()
        if not owner:  # the same constraint is being compiled for another request: wait for it
            wall = None if self.compile_timeout is None else self.compile_timeout * GrammarCompileWorker.WALL_FACTOR
            try:
                return pending.result(timeout=wall)
            except FutureTimeout:
                raise self._timeout_error(key[0], waited=True) from None
        try:
            compiled = self._compile(params, key)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            self.num_compiles += 1
            self._remember(key, compiled)
        pending.set_result(compiled)
        return compiled

    def _remember(self, key: tuple[str, str], compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= int(old.memory_size_bytes)

    def _timeout_error(self, kind: str, waited: bool = False) -> TokenmillError:
        if waited:  # not this constraint's fault: the compiler was busy (try again)
            return EngineOverloadedError(
                f"structured_outputs.{kind}: the grammar compiler was busy with other requests' grammars for too long; try again"
            )
        return InvalidRequestError(
            f"structured_outputs.{kind}: the grammar needs more than the limit of {self.compile_timeout:g} s of CPU time "
            "to compile (grammar_compile_timeout, --grammar-compile-timeout); large maxLength, maxItems or repetition "
            "counts make grammars slow to compile"
        )

    def _compile(self, params: "StructuredOutputsParams", key: tuple[str, str]) -> Any:
        job = compile_job(params)
        try:
            serialized = self.worker.compile(job, self.compile_timeout)
        except GrammarCompileTimeout as exc:
            if not exc.waited:  # this constraint itself is too slow: refuse it at once from now on
                with self._lock:
                    self._timed_out[key] = None
                    while len(self._timed_out) > self._MAX_TIMED_OUT_KEYS:
                        self._timed_out.popitem(last=False)
            raise self._timeout_error(key[0], exc.waited) from None
        except GrammarCompileError as exc:
            raise InvalidRequestError(f"invalid structured_outputs.{key[0]}: {_clean_error(exc)}") from None
        except GrammarWorkerCrashed as exc:
            logger.error("structured output: %s", exc)
            raise InvalidRequestError(f"structured_outputs.{key[0]} could not be compiled: {exc}") from None
        return self._xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)


    # -- per step ---------------------------------------------------------
    def _state(self, request: "Request") -> _MatcherState:
        state = request.structured_output
        if state is None or state.owner is not request:
            compiled = request.compiled_grammar or self.compile(request.sampling_params.structured_outputs)
            state = _MatcherState(request, self._xgr.GrammarMatcher(compiled))
            request.structured_output = state
            for token in request.output_token_ids:  # a forked copy: catch up with its tokens
                self._accept(state, token)
        return state

    def bitmask(self, chunks: list["ScheduledChunk"], requests: dict[str, "Request"]) -> torch.Tensor | None:
        """The step's bitmask over the sampling rows (ScheduledChunk.sampling_rows, in order), or None when
        none is constrained. A chunk's draft rows are masked by the grammar after the drafts before them
        (the matcher takes them, then is rolled back); rows after a draft the grammar refuses stay open,
        as that draft is never kept (its own row's mask refuses it).

        When a row's grammar allows only tokens that min_tokens bans (EOS at the grammar's end), the
        grammar wins: the ban is lifted for that row, as the output cannot go on inside the grammar.
        """
        constrained = []  # (first row, chunk, request)
        num_rows = 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            request = requests.get(chunk.request_id)
            if chunk.sampling_params.structured_outputs is not None and request is not None:
                constrained.append((num_rows, chunk, request))
            num_rows += len(chunk.spec_token_ids) + 1
        if not constrained:
            return None
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # all ones: everything allowed
        for first, chunk, request in constrained:
            state = self._state(request)
            if state.failed:
                continue
            matcher, rows, taken = state.matcher, chunk.sampling_rows(), 0
            for i, row in enumerate(rows):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, first + i)
                if row.banned_token_ids and not self._allows_other_than(bitmask[first + i], row.banned_token_ids):
                    row.banned_token_ids = ()
                if i == len(chunk.spec_token_ids) or not matcher.accept_token(chunk.spec_token_ids[i]):
                    break
                taken += 1
            if taken:
                matcher.rollback(taken)
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
