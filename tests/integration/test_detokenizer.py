"""Incremental detokenization never emits half a multi-byte character."""
from services.frontend.detokenizer import IncrementalDetokenizer


def test_multibyte_characters_are_held_back_until_complete(tokenizer):
    text = "Café — 你好, 世界! 🙂🚀 naïve ☃"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detokenizer.text == text
    assert "" in deltas  # at least one token completed no character on its own


def test_special_tokens_are_skipped(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    ids = tokenizer("Hello", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert detokenizer.add_tokens(ids) == "Hello"
