"""Incremental detokenization and stop strings.

Each new token yields the text it adds, never half of a UTF-8 character: the text of a short
window of recent tokens is decoded with and without the new tokens, and the difference is
only taken once it no longer ends in U+FFFD (a character still missing bytes). The window
starts in the prompt, so the first output token gets its leading space right (SentencePiece
drops a leading space at the start of a text), and the result is the same for byte-level BPE
and byte-fallback SentencePiece. Stop strings are matched in the text, across token
boundaries; while a request runs, the visible text holds back any tail that could still grow
into a stop string, so streamed text never shows what is later cut.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType

from tokenmill.sampling_params import SamplingParams

# Prompt tokens that seed the decoding window (as vLLM's incremental detokenizer does).
_CONTEXT_TOKENS = 8


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_char() -> Mapping[str, int]:
    """GPT-2's byte-level alphabet, reversed: built once per process (it was 90% of the cost of a
    detokenizer, and a request with n sequences builds n of them)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return MappingProxyType({char: byte for byte, char in bytes_to_unicode().items()})


def _byte_level_table(tokenizer) -> Mapping[str, int] | None:
    """For byte-level BPE (GPT-2 style) tokenizers: the byte each token character stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    return _byte_of_char()


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop or []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.vocab_limit = len(tokenizer)  # a model's padded vocabulary can be larger than the tokenizer's
        self._special_ids = frozenset(tokenizer.all_special_ids) if self.skip_special_tokens else frozenset()
        self.text = ""  # everything decoded so far (cut at a stop string once one matched)
        self.num_tokens = 0  # output tokens consumed
        self.stop_reason: str | None = None
        self._byte_of_char = _byte_level_table(tokenizer)
        self._tokens = self._to_tokens(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset, self._read_offset = self._prompt_window()

    def _starts_character(self, token: str) -> bool:
        """Whether a token's first byte begins a UTF-8 character (is not a continuation byte)."""
        match = _BYTE_TOKEN.fullmatch(token)
        if match:  # SentencePiece byte fallback
            first = int(match.group(1), 16)
        elif self._byte_of_char is not None and token[:1] in self._byte_of_char:  # byte-level BPE
            first = self._byte_of_char[token[0]]
        else:
            return True
        return not 0x80 <= first <= 0xBF

    def _prompt_window(self) -> tuple[int, int]:
        """Where the decoding window starts, and where the already-shown prompt text ends.

        The window starts at a character boundary: byte-fallback decoders turn a whole run of
        bytes into U+FFFD when it begins mid-character. If the prompt ends inside a character,
        that character's bytes count as not yet shown, so the output completes it.
        """
        starts = [i for i, token in enumerate(self._tokens) if self._starts_character(token)]
        if not starts:
            return len(self._tokens), len(self._tokens)
        begin = starts[0]
        convert = self.tokenizer.convert_tokens_to_string
        if convert(self._tokens[begin:]).endswith("\ufffd"):
            return begin, starts[-1]
        return begin, len(self._tokens)

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        ids = [t for t in token_ids if t < self.vocab_limit and t not in self._special_ids]
        return self.tokenizer.convert_ids_to_tokens(ids)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Consume new output tokens; returns the stop string if one now matches (the text is cut there)."""
        for token_id in token_ids:
            if self.stop_reason is not None:
                break
            self.num_tokens += 1
            prev_len = len(self.text)
            self.text += self._decode_next(token_id)
            if self.stop and len(self.text) > prev_len and self._match_stop(prev_len):
                return self.stop_reason
        return None

    def _decode_next(self, token_id: int) -> str:
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:
            return ""
        self._tokens.extend(new_tokens)
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self._tokens[self._prefix_offset : self._read_offset])
        full_text = convert(self._tokens[self._prefix_offset :])
        if full_text.endswith("\ufffd"):
            return ""  # an unfinished character: wait for its remaining bytes
        delta = full_text[len(prefix_text) :]
        if delta:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return delta

    def _match_stop(self, prev_len: int) -> bool:
        """Find the earliest stop string that overlaps the new text; cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, prev_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]
        self.stop_reason = stop
        return True

    def output_text(self, finished: bool) -> str:
        """The text a caller may see now: while running, minus any tail that may begin a stop string."""
        if finished or self.stop_reason is not None or not self.stop:
            return self.text
        return self.text[: len(self.text) - self._pending_stop_prefix()]

    def _pending_stop_prefix(self) -> int:
        """The length of the longest tail of the text that begins some stop string (0 if none).

        Only the tail positions holding a stop string's first character are tried, longest first,
        so the usual cost is a few comparisons per stop string, not one per character of it."""
        longest = 0
        text = self.text
        for stop in self.stop:
            span = min(len(stop) - 1, len(text))
            if span <= longest:
                continue
            start = len(text) - span
            i = text.find(stop[0], start)
            while i != -1 and len(text) - i > longest:
                if stop.startswith(text[i:]):
                    longest = len(text) - i
                    break
                i = text.find(stop[0], i + 1)
        return longest
