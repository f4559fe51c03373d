"""The workload: deterministic token-id prompts and greedy sampling to a fixed
length, the same for llmserve and the baseline."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from services.common.sampling_params import SamplingParams

# SmolLM2's special tokens are ids 0..16; prompts never contain them.
FIRST_ORDINARY_ID = 17

# One independent prompt set per use, so no set shares a prefix (and a prefix
# cache hit) with another.
OFFLINE, SINGLE_STREAM, WARMUP, OFFLINE_LARGE, EMBED, BEAM, SPEC, SERVING = 0, 1, 2, 3, 4, 5, 6, 10


def vocab_size(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def make_prompts(count: int, length: int, vocab: int, seed: int,
                 prompt_set: int) -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly from the ordinary tokens."""
    rng = np.random.default_rng([seed, prompt_set])
    return rng.integers(FIRST_ORDINARY_ID, vocab, size=(count, length)).tolist()


def greedy(output_len: int) -> SamplingParams:
    """Greedy, and always exactly output_len tokens."""
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
