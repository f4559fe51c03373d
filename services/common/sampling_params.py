"""SamplingParams: how to pick tokens and when to stop (see protos/common.proto)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument

MAX_LOGPROBS = 20


class OutputKind(enum.IntEnum):
    """How streamed text is reported; values match llmserve.v1.OutputKind."""

    DELTA = 1  # each message carries what is new
    CUMULATIVE = 2  # each message carries everything so far
    FINAL_ONLY = 3  # one message at the end


@dataclass
class SamplingParams:
    # How many completions to generate for the prompt (fanned out by the frontend).
    n: int = 1
    max_tokens: int = 16
    # EOS and stop token ids are masked until this many tokens are generated.
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
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
    # Frontend-only: text stops, detokenization and output shape.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.DELTA

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
            ("n", self.n >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _finite(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
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
        ]
        for name, ok, problem in checks:
            if not ok:
                raise InvalidArgument(f"sampling_params.{name}", problem)
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument("sampling_params.stop_token_ids",
                                  f"{bad[0]} is outside the vocabulary [0, {vocab_size})")


def _finite(x: float) -> bool:
    return math.isfinite(x)
