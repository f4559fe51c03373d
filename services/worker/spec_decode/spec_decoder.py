"""SpecDecoder: the model runner's part of speculative decoding. A step that
computes drafts behind a request's token verifies them; after each step, the
requests the scheduler names get drafts for their next one."""
from __future__ import annotations

import numpy as np
import torch

from services.common.config import SpeculativeConfig
from services.common.request_types import Logprobs
from services.common.scheduler_output import SchedulerOutput
from services.worker.grammar_bitmask import apply_row_bitmasks
from services.worker.input_batch import InputBatch, StepInputs, build_sampling_metadata
from services.worker.spec_decode.draft_model import DraftModelProposer
from services.worker.spec_decode.ngram import NgramProposer
from services.worker.spec_decode.rejection_sampler import RejectionSampler
from services.worker.spec_decode.suffix import SuffixProposer


def _position_bitmasks(request_ids: list[str], counts: np.ndarray,
                       bitmasks: dict[str, np.ndarray]) -> list[np.ndarray | None]:
    """Each position's grammar bitmask: a constrained request has one per position
    (one row each, flattened when it came over the wire), others none."""
    masks: list[np.ndarray | None] = []
    for request_id, count in zip(request_ids, counts.tolist()):
        mask = bitmasks.get(request_id)
        masks += [None] * count if mask is None else list(mask.reshape(count, -1))
    return masks


def make_proposer(config: SpeculativeConfig, input_batch: InputBatch,
                  draft_model: torch.nn.Module | None):
    if config.method == "ngram":
        return NgramProposer(config.num_tokens, *config.lookup_range)
    if config.method == "suffix":
        return SuffixProposer(config.num_tokens, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_min_token_prob)
    if config.method == "draft_model" and draft_model is not None:
        return DraftModelProposer(draft_model, config.num_tokens, input_batch)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, input_batch: InputBatch, vocab_size: int,
                 draft_model: torch.nn.Module | None = None):
        self.input_batch = input_batch
        self.vocab_size = vocab_size
        self.proposer = make_proposer(config, input_batch, draft_model)
        self.rejection_sampler = RejectionSampler()

    def verify(self, step: StepInputs, hidden: torch.Tensor, compute_logits,
               so: SchedulerOutput) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
        """Samples the step's sampling requests, verifying the drafts of those that
        have some: per request, the tokens it emits and their logprobs. A request's
        computed tokens then end after its accepted drafts."""
        batch = self.input_batch
        rows = step.rows[step.sampling]
        request_ids = [r for r, s in zip(step.request_ids, step.sampling) if s]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in request_ids]
        counts = np.array([len(d) + 1 for d in drafts])
        ends = step.query_start_loc[1:][step.sampling]
        positions = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)])
        logits = compute_logits(hidden[torch.from_numpy(positions)])
        apply_row_bitmasks(logits, _position_bitmasks(request_ids, counts, so.grammar_bitmasks))
        # A row per position, each with the tokens before it (the drafts included).
        position_rows = np.repeat(rows, counts)
        offsets = np.arange(len(position_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        meta = build_sampling_metadata(batch, position_rows, self.vocab_size,
                                       batch.num_tokens[position_rows] + offsets)
        result = self.rejection_sampler(logits, meta, drafts)
        # A rejected draft's KV is not the request's: its computed tokens end after
        # the accepted ones.
        num_rejected = [len(d) + 1 - len(t) for d, t in zip(drafts, result.token_ids)]
        batch.num_computed_tokens[rows] -= np.array(num_rejected, dtype=np.int64)
        return result.token_ids, result.logprobs

    def after_step(self, so: SchedulerOutput, request_ids: list[str],
                   rows: np.ndarray) -> dict[str, list[int]]:
        """Drafts for the next step of the requests that sampled this one and that
        the scheduler wants drafts for; then the rows give up the blocks past their
        computed tokens (a draft model wrote its lookahead KV there first)."""
        wanted = set(so.requests_to_draft)
        chosen = [i for i, r in enumerate(request_ids) if r in wanted]
        drafts = self._propose([request_ids[i] for i in chosen], rows[chosen])
        self.input_batch.trim_blocks(rows)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.blocks_trimmed(request_ids, rows)
        return drafts

    def _propose(self, request_ids: list[str], rows: np.ndarray) -> dict[str, list[int]]:
        if not request_ids:
            return {}
        if isinstance(self.proposer, DraftModelProposer):
            proposed = self.proposer.propose_batch(request_ids, rows)
        else:
            batch = self.input_batch
            room = batch.max_model_len - batch.num_tokens[rows] - 1
            proposed = {r: self.proposer.propose(batch.token_history(row), min(self.proposer.k, n))
                        for r, row, n in zip(request_ids, rows.tolist(), room.tolist()) if n > 0}
        return {r: d for r, d in proposed.items() if d}

    def request_added(self, request_id: str) -> None:
        """A row filled (again: a resumed request recomputes everything)."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.forget(request_id)

    def finished(self, request_id: str) -> None:
        """A request is done: suffix decoding keeps its output to draft from."""
        batch = self.input_batch
        row = batch.row_of.get(request_id)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.forget(request_id)
        elif isinstance(self.proposer, SuffixProposer) and row is not None \
                and batch.states[row].pooling_params is None:
            self.proposer.cache_output(batch.token_history(row, int(batch.num_prompt_tokens[row])))
