"""ModelRunner: keeps the persistent batch, prepares inputs, runs the model, samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common import tracing
from services.common.request_types import SamplingParams
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.worker.attention import AttentionMetadata
from services.worker.sampler import Sampler

_tracer = tracing.tracer(__name__)


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    request_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    span: object = field(default=None, repr=False)  # the request's span in this worker


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Requests that sample this step (a partial prefill does not), and the row
    # of the hidden states each one samples from.
    sampling_request_ids: list[str]
    logits_indices: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    def kv_block_bytes(self) -> int:
        layers = self.model.attention_layers
        per_layer = 2 * self.block_size * layers[0].num_kv_heads * layers[0].head_dim
        return per_layer * len(layers) * torch.finfo(self.dtype).bits // 8

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.model.attention_layers:
            cache = torch.zeros(2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                dtype=self.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput()
        batch = self.prepare_inputs(scheduler_output)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        if not batch.sampling_request_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        states = [self.requests[r] for r in batch.sampling_request_ids]
        tokens = self.sampler(logits, [s.sampling_params for s in states],
                              [s.generator for s in states]).tolist()
        for state, token in zip(states, tokens):
            state.token_ids.append(token)
        return ModelRunnerOutput(dict(zip(batch.sampling_request_ids, tokens)))

    def _update_states(self, so: SchedulerOutput) -> None:
        """Applies the step's diff to the persistent batch."""
        for request_id in so.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and state.span is not None:
                state.span.end()
        for new in so.new_requests:
            old = self.requests.get(new.request_id)
            span = old.span if old is not None else _tracer.start_span(
                "worker.request", context=tracing.context_from_headers(new.trace_headers),
                attributes={"gen_ai.request.id": new.request_id})
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), list(new.block_ids),
                new.num_computed_tokens, new.sampling_params, generator, span)
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        """Model inputs for the step; advances each request's num_computed_tokens."""
        bs = self.block_size
        request_ids = list(so.num_scheduled_tokens)
        input_ids, positions, slots, seq_lens, query_start_loc = [], [], [], [], [0]
        sampling_request_ids, logits_indices = [], []
        for request_id in request_ids:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + so.num_scheduled_tokens[request_id]
            pos = np.arange(start, end)
            blocks = np.asarray(state.block_ids)
            input_ids.append(state.token_ids[start:end])
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + end - start)
            if end >= len(state.token_ids):  # prefill done: the last position samples
                sampling_request_ids.append(request_id)
                logits_indices.append(query_start_loc[-1] - 1)
            state.num_computed_tokens = end

        max_blocks = max(-(-n // bs) for n in seq_lens)
        block_table = np.zeros((len(request_ids), max_blocks), dtype=np.int64)
        for i, request_id in enumerate(request_ids):
            ids = self.requests[request_id].block_ids[:max_blocks]
            block_table[i, :len(ids)] = ids
        query_lens = np.diff(query_start_loc)
        decode_idx = np.flatnonzero(query_lens == 1)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32,
                                                device=self.device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            max_query_len=int(query_lens.max()), max_seq_len=max(seq_lens),
            block_table=torch.from_numpy(block_table).to(self.device),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
            block_size=bs,
            decode_request_indices=torch.from_numpy(decode_idx).to(self.device),
            decode_token_indices=torch.tensor([query_start_loc[i] for i in decode_idx],
                                              dtype=torch.int64, device=self.device),
            decode_seq_lens=torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.int64,
                                         device=self.device),
            prefill_request_indices=np.flatnonzero(query_lens > 1).tolist())
        return BatchInputs(
            input_ids=torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int64,
                                   device=self.device),
            positions=torch.from_numpy(np.concatenate(positions)).to(self.device),
            attn_metadata=meta, sampling_request_ids=sampling_request_ids,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device))
