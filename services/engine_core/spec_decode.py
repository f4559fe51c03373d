"""The scheduler's part of speculative decoding: which of a request's drafts a
step verifies, and what the verification tells it.

The workers propose drafts after each step (services/worker/spec_decode/) and
return them with its output; the scheduler keeps them on the request and
schedules them behind its next token, where the workers verify them in the same
forward pass (SchedulerOutput.scheduled_spec_decode_tokens). The step then
emits the accepted drafts and one token of the target's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import SpeculativeConfig
from services.engine_core.request import Request

# A request whose last drafts were all rejected stops drafting for 4, 16, then 64
# steps: drafts that never land cost a draft model's forwards and the verification
# of their positions (ngram's cost little, a draft model's most).
_BACKOFF_BASE = 4
_MAX_BACKOFF = 3


@dataclass
class SpecDecodingStats:
    """Counters since start, with vLLM's names (llmserve:spec_decode_*)."""

    num_drafts: int = 0  # request steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts accepted at position i (the first draft is position 0).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * (config.num_tokens if config.enabled else 0))

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def active(self, num_running: int) -> bool:
        """Whether steps with this many running requests carry drafts."""
        limit = self.config.disable_by_batch_size
        return self.enabled and (limit == 0 or num_running < limit)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a decode allocates past its tokens: a draft model writes the KV of
        its drafts there after the step (the last draft needs none)."""
        return self.config.num_tokens - 1 if self.config.method == "draft_model" else 0

    def wants_drafts(self, request: Request, num_running: int) -> bool:
        """Whether the workers propose drafts for a request that samples this step:
        not while the batch is large, for a beam (its group chooses its tokens), or
        for a request backing off after failed drafts."""
        if not self.active(num_running) or request.beam is not None:
            return False
        acceptance = request.draft_acceptance
        if acceptance.backoff > 0:
            acceptance.backoff -= 1
            return False
        return True

    def drafts_to_verify(self, request: Request, num_running: int) -> list[int]:
        """The drafts to schedule behind the request's next token this step, never
        more than take it to max_tokens or max_model_len."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        # A token in flight (async scheduling, which runs while the batch is large)
        # is one the drafts were not proposed after.
        if (not drafts or not self.active(num_running) or request.num_uncomputed_tokens != 1
                or request.num_output_placeholders):
            return []
        room = min(request.sampling_params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        drafts = drafts[:max(0, room)]
        if request.grammar is not None:  # a draft its grammar forbids would be rejected
            drafts = request.grammar.allowed_drafts(drafts)
        return drafts

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Counts a verification; a request whose last drafts all failed backs off."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1
        acceptance = request.draft_acceptance
        acceptance.num_steps += 1
        acceptance.num_draft_tokens += num_drafts
        acceptance.num_accepted += num_accepted
        if num_accepted:
            acceptance.num_backoffs = 0
        else:
            acceptance.num_backoffs = min(acceptance.num_backoffs + 1, _MAX_BACKOFF)
            acceptance.backoff = _BACKOFF_BASE ** acceptance.num_backoffs
