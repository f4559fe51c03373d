"""Plain dataclasses for requests and outputs that cross the engine core's boundary."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument


class FinishReason(enum.IntEnum):
    """Why a request stopped; values match llmserve.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (see protos/common.proto)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidArgument naming the first bad field."""
        if self.max_tokens < 1:
            raise InvalidArgument("sampling_params.max_tokens", "must be >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidArgument("sampling_params.temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("sampling_params.top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidArgument("sampling_params.top_k", "must be >= 0 (0 disables it)")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument("sampling_params.stop_token_ids",
                                  f"{bad[0]} is outside the vocabulary [0, {vocab_size})")


@dataclass
class EngineCoreRequest:
    """A tokenized request, as the frontend hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    trace_headers: dict[str, str] = field(default_factory=dict)
    # Lower values are served first under the priority scheduling policy.
    priority: int = 0


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Load and KV cache figures of an engine core (see EngineStats in engine_core.proto)."""

    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions_total: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_cached_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    num_scheduled_tokens_last_step: int


@dataclass
class EngineInfo:
    """An engine core's model and KV cache configuration."""

    model_path: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    dtype: str
    vocab_size: int


@dataclass
class LoadedModel:
    """What a worker reports once it has loaded the model."""

    vocab_size: int
    dtype: str  # "auto" resolved, e.g. "float32"
    kv_block_bytes: int  # bytes one KV block takes across all layers
