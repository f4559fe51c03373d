"""SpecDecoder: the model runner's part of speculative decoding. After each step
it proposes drafts for the requests that sampled; in the next step, which
computes those drafts behind each request's token, it verifies them."""
from __future__ import annotations

import numpy as np
import torch

from services.common.config import SpeculativeConfig
from services.common.request_types import Logprobs
from services.common.scheduler_output import SchedulerOutput
from services.worker.grammar_bitmask import apply_grammar_bitmasks
from services.worker.input_batch import InputBatch, StepInputs, build_sampling_metadata
from services.worker.spec_decode.ngram import NgramProposer
from services.worker.spec_decode.rejection_sampler import RejectionSampler
from services.worker.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer:
    if config.method == "ngram":
        return NgramProposer(config.num_tokens, *config.lookup_range)
    if config.method == "suffix":
        return SuffixProposer(config.num_tokens, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_min_token_prob)
    raise ValueError(f"speculative_config.method {config.method!r} has no proposer")


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, input_batch: InputBatch, vocab_size: int):
        self.config = config
        self.input_batch = input_batch
        self.vocab_size = vocab_size
        self.proposer = make_proposer(config)
        self.rejection_sampler = RejectionSampler()

    def verify(self, step: StepInputs, hidden: torch.Tensor, compute_logits,
               so: SchedulerOutput) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
        """Samples the step's sampling requests, verifying the drafts of those that
        have some: per request, the tokens it emits and their logprobs."""
        batch = self.input_batch
        rows = step.rows[step.sampling]
        request_ids = [r for r, s in zip(step.request_ids, step.sampling) if s]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in request_ids]
        counts = np.array([len(d) + 1 for d in drafts])
        ends = step.query_start_loc[1:][step.sampling]
        positions = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)])
        logits = compute_logits(hidden[torch.from_numpy(positions)])
        # Only requests without drafts have grammars (the scheduler's rule): one row each.
        apply_grammar_bitmasks(logits, list(np.repeat(request_ids, counts)), so.grammar_bitmasks)
        # A row per position, each with the tokens before it (the drafts included).
        position_rows = np.repeat(rows, counts)
        offsets = np.arange(len(position_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        meta = build_sampling_metadata(batch, position_rows, self.vocab_size,
                                       batch.num_tokens[position_rows] + offsets)
        result = self.rejection_sampler(logits, meta, drafts)
        starts = step.starts[step.sampling]
        for row, start, tokens, d in zip(rows.tolist(), starts, result.token_ids, drafts):
            if d:  # its KV holds its last token and the accepted drafts
                batch.settle_drafts(row, int(start) + len(tokens))
        return result.token_ids, result.logprobs

    def propose(self, request_ids: list[str], rows: np.ndarray) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled this one; none
        while the batch is at disable_by_batch_size, or for a request whose next
        step cannot take them (structured outputs, or no room left)."""
        limit = self.config.disable_by_batch_size
        if limit and len(request_ids) >= limit:
            return {}
        batch = self.input_batch
        drafts = {}
        for request_id, row in zip(request_ids, rows.tolist()):
            params = batch.states[row].sampling_params
            room = batch.max_model_len - int(batch.num_tokens[row]) - 1
            if params.structured_outputs is not None or room <= 0:
                continue
            proposed = self.proposer.propose(batch.token_history(row), min(self.proposer.k, room))
            if proposed:
                drafts[request_id] = proposed
        return drafts

    def finished(self, row: int) -> None:
        """A request is done: suffix decoding keeps its output to draft from."""
        cache = getattr(self.proposer, "cache_output", None)
        state = self.input_batch.states[row]
        if cache is not None and state.pooling_params is None:
            cache(self.input_batch.token_history(row, int(self.input_batch.num_prompt_tokens[row])))
