"""Incremental detokenization: text deltas as tokens arrive, never half a character."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Wraps tokenizers' DecodeStream, which holds tokens back until they decode to
    complete UTF-8 characters."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer.backend_tokenizer  # the Rust tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str:
        """Returns the text the new tokens complete (possibly empty)."""
        delta = []
        for token_id in token_ids:
            chunk = self._stream.step(self._tokenizer, token_id)
            if chunk:
                delta.append(chunk)
        text = "".join(delta)
        self.text += text
        return text
