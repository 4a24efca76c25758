"""Incremental detokenization: each new token yields the text it adds, never a broken UTF-8 character."""

from __future__ import annotations

# Prompt tokens fed to the decoder as context, so the first output token gets its
# leading space right (SentencePiece drops it at the start of a text).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._output_ids: list[int] = []
        self._stream = None
        if self.backend is not None:
            context = prompt_token_ids[-_CONTEXT_TOKENS:]
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Feed one new token; returns the text it completes (possibly '')."""
        if self._stream is not None:
            delta = self._stream.step(self.backend, token_id) or ""
        else:  # slow tokenizers: decode everything and hold back an unfinished character
            self._output_ids.append(token_id)
            full = self.tokenizer.decode(self._output_ids, skip_special_tokens=self.skip_special_tokens)
            delta = "" if full.endswith("\ufffd") else full[len(self.text) :]
        self.text += delta
        return delta
