"""Plain dataclasses for requests and outputs that cross the engine core's boundary."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.beam_search import BeamSearch
from services.common.lora import LoRARequest
from services.common.pooling_params import PoolingParams
from services.common.request_events import RequestEvent
from services.common.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped; values match llmserve.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class Logprobs:
    """Log-probabilities at one position: the chosen token's, then the top ones."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # The text of token_id and of each top token; filled in by the frontend.
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)


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
    # Waiting-queue slots it needs free to be admitted: itself and the choices
    # of its request still to come (n - choice index), so that n choices count n
    # times against the queue limit and the first is refused, not the last.
    queue_slots: int = 1
    # Tokens already generated on an engine core that died: it goes on after them.
    output_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter to run with (added to the engine core on first use); None: the base model.
    lora_request: LoRARequest | None = None
    # A pooling request (pooling_type resolved): prefill only, its output one vector.
    # Its sampling_params are unused.
    pooling_params: PoolingParams | None = None
    # A beam-search request: its one output, at the end, carries the beams.
    beam_search: BeamSearch | None = None


@dataclass
class BeamSequence:
    """One finished beam of a beam-search request."""

    token_ids: list[int]  # the output, a final EOS or stop token included
    cum_logprob: float
    # The length-penalized score it was ranked by (beam_search.beam_score).
    score: float
    finish_reason: FinishReason
    # The stop token id or stop string that ended it; None for EOS and length.
    stop_reason: int | str | None = None
    # One per output token, when the request asked for logprobs.
    logprobs: list[Logprobs] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    # One per new token, when the request asked for logprobs.
    new_logprobs: list[Logprobs] = field(default_factory=list)
    # Prompt positions computed in this step, when it asked for prompt_logprobs
    # (the first prompt token has none and is skipped).
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    # The request's lifecycle in the engine core: on its last output only.
    events: list[RequestEvent] = field(default_factory=list)
    # A pooling request's vector, on its only (finished) output.
    pooled: list[float] | None = None
    # A beam-search request's beams, best first, on its only (finished) output.
    beams: list[BeamSequence] = field(default_factory=list)
    # Speculative decoding, on the last output only: its draft tokens verified,
    # those accepted, and its steps that verified drafts.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0

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
    # Speculative decoding (engine_core/spec_decode.py SpecDecodingStats).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineInfo:
    """An engine core's model and KV cache configuration."""

    model_path: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    dtype: str
    vocab_size: int
    hidden_size: int = 0  # values in a pooled vector (before `dimensions`)
    runner: str = "generate"  # what the served APIs offer: generate, or pooling (embed)


@dataclass
class LoadedModel:
    """What a worker reports once it has loaded the model."""

    vocab_size: int
    dtype: str  # "auto" resolved, e.g. "float32"
    kv_block_bytes: int  # bytes one KV block takes across all layers
    hidden_size: int = 0
