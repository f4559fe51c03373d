"""Loads a model directory's tokenizer and the token ids that end generation."""
from __future__ import annotations

import os

from transformers import AutoTokenizer, GenerationConfig

from services.common.model_store import find_gguf


def load_tokenizer(model_dir: str):
    """The tokenizer, and the EOS ids of both the tokenizer and generation_config.json
    (`model_dir` may also be a GGUF file or a directory holding one)."""
    gguf = find_gguf(model_dir)
    if gguf is not None:  # the tokenizer is inside the GGUF file
        directory, filename = os.path.split(gguf)
        return _with_eos(AutoTokenizer.from_pretrained(directory, gguf_file=filename), None)
    return _with_eos(AutoTokenizer.from_pretrained(model_dir), model_dir)


def _with_eos(tokenizer, model_dir: str | None):
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if model_dir and os.path.exists(os.path.join(model_dir, "generation_config.json")):
        configured = GenerationConfig.from_pretrained(model_dir).eos_token_id
        eos.update(configured if isinstance(configured, list) else
                   [] if configured is None else [configured])
    return tokenizer, sorted(eos)


def check_draft_tokenizer(model_dir: str, draft_dir: str) -> None:
    """ValueError unless the draft model's tokenizer is the target's: its drafts are
    token ids, and the target must read them as the same text."""
    target, _ = load_tokenizer(model_dir)
    draft, _ = load_tokenizer(draft_dir)
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"speculative_config.model: the draft model {draft_dir} has another "
                         f"tokenizer than {model_dir}; a draft model must share the target's")
