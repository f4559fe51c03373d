"""Incremental detokenization: text deltas as tokens arrive, never half a character."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from services.common.request_types import Logprobs


class IncrementalDetokenizer:
    """Wraps tokenizers' DecodeStream, which holds tokens back until they decode to
    complete UTF-8 characters."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
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


def add_token_texts(tokenizer, logprobs: list[Logprobs]) -> None:
    """Fills in the text of each position's token and top tokens, one decode for all
    (each token decoded alone, as vLLM's Logprob.decoded_token is)."""
    if not logprobs:
        return
    ids = [[t] for lp in logprobs for t in [lp.token_id, *lp.top_token_ids]]
    texts = iter(tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=False))
    for lp in logprobs:
        lp.token = next(texts)
        lp.top_tokens = [next(texts) for _ in lp.top_token_ids]
