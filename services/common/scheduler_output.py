"""The step protocol between engine core and workers: a diff per step.

Workers keep a persistent batch; each step the scheduler sends only what changed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.pooling_params import PoolingParams
from services.common.request_types import Logprobs
from services.common.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen yet (or see again after preemption)."""

    request_id: str
    # NOTE: the prompt, then any output tokens already generated; a request
    # resumed after preemption recomputes all of them.
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens whose KV is already cached (prefix cache hit).
    num_computed_tokens: int
    trace_headers: dict[str, str] = field(default_factory=dict)
    # Masked with stop_token_ids until min_tokens; empty when ignore_eos is set.
    eos_token_ids: list[int] = field(default_factory=list)
    # How many of token_ids are the prompt (see NOTE above); None: all.
    num_prompt_tokens: int | None = None
    # The LoRA adapter it runs with (loaded into the workers beforehand); 0: none.
    lora_id: int = 0
    # A pooling request: the workers pool its prompt's hidden states, sample nothing.
    pooling_params: PoolingParams | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.token_ids)


@dataclass
class CachedRequestData:
    """A request scheduled in an earlier step too."""

    request_id: str
    # Blocks appended to the request's block table since its last step.
    new_block_ids: list[int]
    # Tokens whose KV is in the cache before this step.
    num_computed_tokens: int
    # Pipeline parallelism only: the request's output tokens from position
    # max(num_computed_tokens, its prompt length) on. No stage but the last sees
    # what it samples, and a request is not scheduled again before its batch is
    # back, so these are known here and are the tokens the workers lack.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    # The scheduler's count of the steps it sent, from 1; workers run steps in
    # this order, whatever order the calls arrive in (async scheduling).
    step_id: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step, per request (new and cached).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Finished or aborted since the last step: workers drop their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Structured-outputs requests that sample this step: int32 [ceil(vocab / 32)],
    # bit t set where token t may be sampled; with drafts, one such row per
    # position verified ([drafts + 1, words]).
    grammar_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)
    # Beam search: (source, destination) KV blocks to copy before this step's
    # forward; a fork's shared partial block, about to be written.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens each request verifies this step, in
    # its num_scheduled_tokens after the token it would compute without them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: the requests sampling this step that the workers
    # propose drafts for, for their next step.
    requests_to_draft: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing for workers to drop."""
        return (not self.num_scheduled_tokens and not self.finished_request_ids
                and not self.blocks_to_copy)


@dataclass
class ModelRunnerOutput:
    """What one step produced.

    NOTE: a request whose prefill is not finished (a partial chunk) has no
    sampled token; it may still have prompt logprobs.
    """

    # Per request, the tokens it emits: one, or with draft tokens to verify, the
    # accepted drafts and then the target's own token.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The logprobs of each sampled token, for requests that asked for them.
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Speculative decoding: drafts proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Pooling requests whose prompt this step finished: their vectors.
    pooled: dict[str, list[float]] = field(default_factory=dict)
