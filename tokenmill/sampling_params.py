"""SamplingParams: vLLM's names and meanings, validated on construction.

Every bad value raises ValueError naming the parameter and what is allowed.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
# Integer parameters become int64 tensors in the sampler: anything larger is refused here, at
# construction, rather than overflowing inside an engine step that other requests share.
INT64_MAX = (1 << 63) - 1
# Stop strings are matched against every request's text at every step, on the output thread all
# requests share: their number and length are bounded, so one request cannot slow the others.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 256


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int_list(name: str, values, allow_empty: bool = True) -> list[int]:
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of non-negative integers, got {values!r}")
    values = list(values)
    bad = [t for t in values if not _is_int(t) or not 0 <= t <= INT64_MAX]
    if bad:
        raise ValueError(f"{name} must be non-negative integers below 2**63, got {bad[:5]}")
    if not values and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    return [int(t) for t in values]


def _str_list(name: str, values) -> list[str]:
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, (list, tuple)) or not all(isinstance(s, str) for s in values):
        raise ValueError(f"{name} must be a string or a list of strings, got {values!r}")
    if any(s == "" for s in values):
        raise ValueError(f"{name} must not contain empty strings")
    for s in values:
        check_text(name, s)
    return list(values)


def check_text(name: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as JSON's "\\ud800"): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode: it holds the lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}"
        ) from None


@dataclass
class StructuredOutputsParams:
    """Constrain the output: exactly one of json (a JSON schema), regex, choice, grammar (EBNF), json_object."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got {type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be an EBNF string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint, for caching compiled grammars."""
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None:
                text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
                return (kind, text + ("|compact" if self.disable_any_whitespace else ""))
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        return ("json_object", "compact" if self.disable_any_whitespace else "")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Types first, so a wrong type gets a ValueError naming the parameter, not a TypeError from a comparison.
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("max_tokens", "seed", "best_of", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer or None, got {value!r}")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "best_of"):
            value = getattr(self, name)
            if value is not None and not -INT64_MAX - 1 <= value <= INT64_MAX:
                raise ValueError(f"{name} must be below 2**63, got {value}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # Plain Python types from here on (numpy scalars and the like are accepted above).
        # Token id lists as sets in first-seen order: a long list of repeats would only cost every step.
        self.stop_token_ids = list(dict.fromkeys(_int_list("stop_token_ids", self.stop_token_ids)))
        self.stop = _str_list("stop", self.stop)
        self.bad_words = _str_list("bad_words", self.bad_words)
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters, "
                f"got {len(self.stop)} (longest {max(map(len, self.stop))})"
            )
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(
                dict.fromkeys(_int_list("allowed_token_ids", self.allowed_token_ids, allow_empty=False))
            )
        self.n, self.top_k, self.min_tokens = int(self.n), int(self.top_k), int(self.min_tokens)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))
        for name in ("max_tokens", "seed", "best_of", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))

        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            else:
                raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs have no effect, as in vLLM.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalty: the sampler reads the token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated (best_of, or n); the best n are returned."""
        return self.best_of or self.n


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)  # OpenAI sends the keys as strings
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be non-negative token ids below 2**63, got {token}")
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r}")
        out[token] = max(-100.0, min(100.0, float(value)))  # OpenAI's range
    return out


@dataclass
class BeamSearchParams:
    """LLM.beam_search settings (vLLM's names)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic here: temperature must be 0")
