"""SamplingParams: how to pick tokens and when to stop (see protos/common.proto).

Keyword names, defaults and meanings are vLLM's, so `SamplingParams(...)` written
for vLLM means the same here."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.common.structured_outputs import StructuredOutputsParams

# Bounds on what one request may ask for (documented in protos/inference.proto):
# each keeps the per-request work, and what one request can hold, small.
MAX_LOGPROBS = 20
MAX_N = 16  # choices; each is an engine request with its own KV cache
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# vLLM clamps logit_bias values to this range.
MAX_LOGIT_BIAS = 100.0


class OutputKind(enum.IntEnum):
    """How streamed text is reported; values match llmserve.v1.OutputKind."""

    DELTA = 1  # each message carries what is new
    CUMULATIVE = 2  # each message carries everything so far
    FINAL_ONLY = 3  # one message at the end


# vLLM's name for it (vllm.sampling_params.RequestOutputKind).
RequestOutputKind = OutputKind


@dataclass
class SamplingParams:
    # How many completions to generate for the prompt (fanned out by the frontend).
    n: int = 1
    # None: as many as max_model_len leaves after the prompt.
    max_tokens: int | None = 16
    # EOS and stop token ids are masked until this many tokens are generated.
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off
    # > 1 discourages tokens already in the prompt or output (vLLM/HF semantics).
    repetition_penalty: float = 1.0
    # Subtracted from the logit of every token already generated (once).
    presence_penalty: float = 0.0
    # Subtracted from a token's logit once per time it was generated.
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Top logprobs per generated token (0: only the chosen token's); None: off.
    logprobs: int | None = None
    # Top logprobs per prompt token; None: off.
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before sampling, clamped to +-100.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # When not empty, only these token ids can be generated.
    allowed_token_ids: list[int] = field(default_factory=list)
    # Token-id sequences that are never generated: the last token of each is
    # banned wherever the output so far ends with the ones before it. The
    # frontend adds the tokenizations of bad_words.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # A constraint the output must satisfy (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputsParams | None = None
    # Frontend-only: text stops, bad words, detokenization and output shape.
    stop: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's default; the gRPC API defaults to DELTA (see convert.py).
    output_kind: OutputKind = OutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # vLLM accepts a single stop string, None for empty lists, and -1 for
        # "top_k off"; normalize once so every consumer sees one form.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words",
                     "bad_words_token_ids"):
            if getattr(self, name) is None:
                setattr(self, name, [])
        if self.logit_bias is None:
            self.logit_bias = {}
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidArgument naming the first bad field."""
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= (self.max_tokens or math.inf),
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _finite(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 or -1 disables it)"),
            ("min_p", _finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", _finite(self.repetition_penalty)
             and self.repetition_penalty > 0, "must be > 0 (1 disables it)"),
            ("presence_penalty", _finite(self.presence_penalty)
             and -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", _finite(self.frequency_penalty)
             and -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            ("stop", all(self.stop), "stop strings must not be empty"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS,
             f"at most {MAX_STOP_STRINGS} stop strings (got {len(self.stop)})"),
            ("stop", all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"each stop string has at most {MAX_STOP_STRING_CHARS} characters"),
            ("bad_words", all(w.strip() for w in self.bad_words), "words must not be empty"),
            ("logit_bias", all(map(_finite, self.logit_bias.values())), "biases must be finite"),
            ("bad_words_token_ids", all(self.bad_words_token_ids),
             "token sequences must not be empty"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise InvalidArgument(f"sampling_params.{name}", problem)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        id_fields = {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias),
                     "allowed_token_ids": self.allowed_token_ids,
                     "bad_words_token_ids": [t for seq in self.bad_words_token_ids for t in seq]}
        for name, ids in id_fields.items():
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"sampling_params.{name}",
                                      f"{bad} is outside the vocabulary [0, {vocab_size})")


def _finite(x: float) -> bool:
    return math.isfinite(x)
