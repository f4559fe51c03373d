"""Request: the engine core's state of one request."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common import tracing
from services.common.request_events import RequestEvent, RequestEventKind
from services.common.pooling_params import PoolingParams
from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams

if TYPE_CHECKING:
    from services.engine_core.beam_search import BeamState
    from services.engine_core.grammar import RequestGrammar


@dataclass
class DraftAcceptance:
    """A request's record of its speculative drafts: where they keep failing, it
    stops drafting for a while (spec_decode.py)."""

    num_steps: int = 0  # steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted: int = 0
    backoff: int = 0  # steps left without drafts
    num_backoffs: int = 0  # consecutive ones (spec_decode.py says how long each lasts)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV cache dropped, to be recomputed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    trace_headers: dict[str, str] = field(default_factory=dict)
    # Lower values are served first under the priority policy.
    priority: int = 0
    # Waiting-queue slots it needs to be admitted (EngineCoreRequest.queue_slots).
    queue_slots: int = 1
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose KV is in the cache (or is being computed by a step in flight).
    num_computed_tokens: int = 0
    # Tokens sampled by steps still in flight (async scheduling), not yet in
    # output_token_ids: the next step already computes the first of them.
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache when first scheduled.
    num_cached_tokens: int = 0
    # The step that first scheduled it (SchedulerOutput.step_id); 0: none yet.
    first_step_id: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # NOTE: always prompt_token_ids + output_token_ids, kept to avoid a copy per step.
    all_token_ids: list[int] = field(init=False)
    # Prompt tokens whose logprobs were sent (prompt_logprobs requests).
    num_prompt_logprobs_reported: int = 0
    # Prefix-cache hashes of the full blocks of all_token_ids computed so far.
    block_hashes: list[bytes] = field(default_factory=list)
    # What happened to it and when (its phase spans and metrics).
    events: list[RequestEvent] = field(default_factory=list)
    # Its structured-outputs constraint, following output_token_ids; None: unconstrained.
    grammar: RequestGrammar | None = None
    # Its LoRA adapter's id; 0: the base model.
    lora_id: int = 0
    # A pooling request: prefill only, finished with its pooled vector.
    pooling_params: PoolingParams | None = None
    # A beam of a beam-search request (beam_search.py); None: an ordinary request.
    beam: BeamState | None = None
    # Speculative decoding: drafts the workers proposed for its next step.
    spec_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest,
                                 grammar: RequestGrammar | None = None) -> "Request":
        return cls(request_id=request.request_id, grammar=grammar,
                   prompt_token_ids=list(request.prompt_token_ids),
                   sampling_params=request.sampling_params,
                   eos_token_ids=frozenset(request.eos_token_ids),
                   trace_headers=dict(request.trace_headers), priority=request.priority,
                   queue_slots=request.queue_slots,
                   output_token_ids=list(request.output_token_ids),
                   lora_id=request.lora_request.lora_int_id if request.lora_request else 0,
                   pooling_params=request.pooling_params)

    @functools.cached_property
    def trace_link(self):
        """Its span (trace_headers) as a link of the steps that serve it, parsed
        once rather than every step (a step of 64 requests spent more time
        parsing their headers than making its span; bench/NOTES.md)."""
        return tracing.link_to(self.trace_headers)

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs need the logits of every prompt position, MEAN pooling the
        hidden state of each and CLS the first's: no prefix cache hit may skip them."""
        pooling = self.pooling_params
        return (self.sampling_params.prompt_logprobs is not None
                or (pooling is not None and pooling.pooling_type != "LAST"))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens, in-flight ones included, whose KV no step has computed yet."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    def in_flight_tokens_end_it(self, max_model_len: int) -> bool:
        """Its in-flight tokens take it to max_tokens or max_model_len: no step after
        them can add one."""
        pending = self.num_output_placeholders
        return pending > 0 and self.at_length_limit(max_model_len, pending)

    def at_length_limit(self, max_model_len: int, extra_tokens: int = 0) -> bool:
        """Whether extra_tokens more take it to max_tokens or max_model_len."""
        return (self.num_output_tokens + extra_tokens >= self.sampling_params.max_tokens
                or self.num_tokens + extra_tokens >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def record(self, kind: RequestEventKind, num_tokens: int = 0) -> None:
        self.events.append(RequestEvent(kind, time.time_ns(), num_tokens))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:  # it follows output_token_ids, always
            self.grammar.accept(token_id)

    def stop_reason_after_last_token(self, max_model_len: int) -> FinishReason | None:
        """The finish reason the newest output token triggers, if any."""
        token = self.output_token_ids[-1]
        params = self.sampling_params
        if self.grammar is not None and self.grammar.is_done:
            return FinishReason.STOP
        # NOTE: the sampler masks EOS and stop ids until min_tokens is reached.
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if self.at_length_limit(max_model_len):
            return FinishReason.LENGTH
        return None
