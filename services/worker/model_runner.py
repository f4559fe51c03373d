"""ModelRunner: applies the step diff to the persistent batch, runs the model, samples."""
from __future__ import annotations

import numpy as np
import torch

from services.common import tracing
from services.common.config import SpeculativeConfig
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.grammar_bitmask import apply_grammar_bitmasks
from services.worker.host_memory import zeros_on_huge_pages
from services.worker.lora.manager import LoRAManager
from services.worker.input_batch import (InputBatch, RequestState, StepInputs,
                                         build_sampling_metadata)
from services.worker.pooler import pool_step
from services.worker.sampler import Sampler, gather_logprobs
from services.worker.spec_decode.spec_decoder import SpecDecoder

_tracer = tracing.tracer(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device,
                 kv_cache_dtype: torch.dtype, max_model_len: int,
                 decode_graphs: DecodeGraphs | None = None, lora: LoRAManager | None = None,
                 activation_dtype: torch.dtype = torch.float32,
                 speculative_config: SpeculativeConfig | None = None,
                 draft_model: torch.nn.Module | None = None):
        self.model = model
        # This worker's pipeline stage (SINGLE_STAGE without pipeline parallelism).
        self.stage = model.stage
        self.activation_dtype = activation_dtype  # of what stages hand each other
        self.block_size = block_size
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler()
        self.input_batch = InputBatch(max_model_len, block_size, device)
        self.kv_caches: list[torch.Tensor] = []
        # CUDA graphs for decode-only steps (None: every step runs eagerly).
        self.decode_graphs = decode_graphs
        self.lora = lora  # None: LoRA off
        self.spec_decoder = None  # None: speculative decoding off
        if speculative_config is not None and speculative_config.enabled:
            self.spec_decoder = SpecDecoder(speculative_config, self.input_batch, self.vocab_size,
                                            draft_model)
        # The layers with a KV cache: a draft model's too, over the same block ids.
        self.cache_layers = list(model.attention_layers) + (
            list(draft_model.attention_layers) if draft_model is not None else [])

    def kv_block_bytes(self) -> int:
        per_token = sum(2 * layer.num_kv_heads * layer.head_dim for layer in self.cache_layers)
        return self.block_size * per_token * torch.finfo(self.kv_cache_dtype).bits // 8

    def init_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv_cache(num_blocks)
        if self.decode_graphs is not None and self.decode_graphs.capture:
            self.decode_graphs.capture_all()  # the graphs read these very cache tensors

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.cache_layers:
            # Each backend lays its cache out as its kernels read it best.
            shape = layer.backend.kv_cache_shape(num_blocks, self.block_size,
                                                 layer.num_kv_heads, layer.head_dim)
            cache = (zeros_on_huge_pages(shape, self.kv_cache_dtype) if self.device.type == "cpu"
                     else torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
            layer.kv_cache = layer.backend.bind_cache(cache, self.block_size)
            self.kv_caches.append(cache)

    def profile_peak_memory(self) -> int:
        """CUDA: peak memory of a forward pass over (almost) max_model_len tokens, weights
        included, the temporary KV cache it needs excluded; plus what the decode graphs
        will hold."""
        # One short of max_model_len: the token it samples needs a place in the batch.
        num_tokens = self.input_batch.max_model_len - 1
        num_blocks = -(-num_tokens // self.block_size)
        self._allocate_kv_cache(num_blocks)
        cache_bytes = num_blocks * self.kv_block_bytes()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.execute_model(SchedulerOutput(
            new_requests=[NewRequestData("profile", [0] * num_tokens, SamplingParams(max_tokens=1),
                                         list(range(num_blocks)), 0)],
            num_scheduled_tokens={"profile": num_tokens}))
        torch.cuda.synchronize(self.device)
        # Reserved, not allocated: the driver sees the allocator's rounding and fragments.
        peak = torch.cuda.max_memory_reserved(self.device) - cache_bytes
        self.update_states(SchedulerOutput(finished_request_ids=["profile"]))
        self._allocate_kv_cache(0)
        torch.cuda.empty_cache()
        return peak + self._profile_graph_memory()

    def _profile_graph_memory(self) -> int:
        """CUDA: the memory the decode graphs will hold, from one trial capture over a
        one-block cache (captured again over the real cache by init_kv_cache)."""
        if self.decode_graphs is None or not self.decode_graphs.capture:
            return 0
        self._allocate_kv_cache(1)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.decode_graphs.capture_all()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.decode_graphs.release()
        self._allocate_kv_cache(0)
        torch.cuda.empty_cache()
        return max(0, used)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput()
        step = self.input_batch.prepare(scheduler_output)
        if self.lora is not None:
            states = self.input_batch.states
            self.lora.set_step([states[row].lora_id for row in step.rows],
                               np.diff(step.query_start_loc).tolist())
        prompt_logprobs = self._prompt_logprobs_wanted(step) if self.stage.is_last else []
        output_rows = None if prompt_logprobs else self._output_rows(step, scheduler_output)
        hidden = self._forward(step, output_rows)
        if hidden is None:  # a stage before the last: the last one samples
            return ModelRunnerOutput()
        output = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(prompt_logprobs, hidden))
        if step.pooling.any():
            output.pooled = pool_step(self.input_batch, step, hidden)
        rows = step.rows[step.sampling]
        if not len(rows):
            return output
        sampled_ids = [r for r, s in zip(step.request_ids, step.sampling) if s]
        if scheduler_output.scheduled_spec_decode_tokens:
            tokens, logprobs = self.spec_decoder.verify(step, hidden, self.model.compute_logits,
                                                        scheduler_output)
            self.input_batch.append_token_lists(rows, tokens)
        else:
            sampled = hidden if output_rows is not None else hidden[step.logits_indices]
            tokens, logprobs = self._sample(sampled, scheduler_output, sampled_ids, rows)
        output.sampled_token_ids = dict(zip(sampled_ids, tokens))
        output.logprobs = {r: lp for r, lp in zip(sampled_ids, logprobs) if lp is not None}
        if self.spec_decoder is not None:
            output.spec_token_ids = self.spec_decoder.after_step(scheduler_output, sampled_ids,
                                                                 rows)
        return output

    def _sample(self, hidden: torch.Tensor, so: SchedulerOutput, sampled_ids: list[str],
                rows: np.ndarray):
        """One token per sampling request from its row of `hidden`, and its logprobs
        (or None), each in a list."""
        logits = self.model.compute_logits(hidden)
        apply_grammar_bitmasks(logits, sampled_ids, so.grammar_bitmasks)
        meta = build_sampling_metadata(self.input_batch, rows, self.vocab_size)
        tokens, logprobs = self.sampler(logits, meta)
        tokens = tokens.cpu().numpy()
        if self.stage.size == 1:  # else every stage takes them from the scheduler
            self.input_batch.append_tokens(rows, tokens)
        return ([[t] for t in tokens.tolist()],
                [None if lp is None else [lp] for lp in logprobs])

    def _output_rows(self, step: StepInputs, so: SchedulerOutput) -> torch.Tensor | None:
        """The rows whose final hidden states this step reads, where fewer than all
        (None: all): the sampled ones. All with pooling or drafts to verify, which
        read more, and under LoRA adapters, whose per-token slots span every row
        (the caller keeps all for prompt logprobs)."""
        num_tokens, num_sampled = len(step.input_ids), int(step.sampling.sum())
        if num_sampled == num_tokens or step.pooling.any() or so.scheduled_spec_decode_tokens:
            return None
        if self.lora is not None and self.lora.tokens.slots is not None:
            return None
        if not num_sampled:  # prompt chunks only: one row, read by no one
            return torch.tensor([num_tokens - 1])
        return step.logits_indices

    def _forward(self, step: StepInputs, output_rows: torch.Tensor | None) -> torch.Tensor | None:
        """The final hidden states (of `output_rows` only, where given); None on a
        pipeline stage before the last, which hands its output to the next stage
        instead."""
        meta, graphs, stage = step.attn_metadata, self.decode_graphs, self.stage
        if graphs is not None and graphs.can_run(len(step.input_ids), meta.max_query_len):
            hidden = graphs.run(step.input_ids, step.positions, meta)
            return hidden if output_rows is None else hidden[output_rows]
        intermediate = None
        if not stage.is_first:
            intermediate = stage.recv(len(step.input_ids), self.model.config.hidden_size,
                                      self.activation_dtype, self.device)
        out = self.model(step.input_ids, step.positions, meta, intermediate, output_rows)
        if stage.is_last:
            return out
        stage.send(out)
        return None

    def update_states(self, so: SchedulerOutput) -> None:
        """Applies the step's diff to the persistent batch."""
        batch = self.input_batch
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        for request_id in so.finished_request_ids:
            if self.spec_decoder is not None:
                self.spec_decoder.finished(request_id)
            state = batch.remove(request_id)
            if state is not None and state.span is not None:
                state.span.end()
        for new in so.new_requests:
            old = batch.state_of(new.request_id)  # set when resumed after a preemption
            span = old.span if old is not None else self._request_span(new)
            generator = None  # seeded for each draw (input_batch.py)
            if new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
            batch.add(new, RequestState(new.request_id, new.sampling_params, new.eos_token_ids,
                                        generator, span, new.lora_id, new.pooling_params))
            if self.spec_decoder is not None:
                self.spec_decoder.request_added(new.request_id)
        for cached in so.cached_requests:
            if cached.new_token_ids:  # pipeline parallelism: the tokens sampled since
                batch.set_output_tokens(cached.request_id, cached.num_computed_tokens,
                                        cached.new_token_ids)
            batch.append_blocks(cached.request_id, cached.new_block_ids)
            batch.set_num_computed(cached.request_id, cached.num_computed_tokens)
        for request_id, drafts in so.scheduled_spec_decode_tokens.items():
            batch.set_drafts(request_id, drafts)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Beam search's copy-on-write, in every layer this worker holds. Each
        backend's cache is [2 (keys, values), num_blocks, ...]: blocks are dim 1."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @staticmethod
    def _request_span(new: NewRequestData):
        """The request's span in this worker, a child of its engine-core span; none
        when nothing is exported (this runs once per request on the step path)."""
        if not tracing.is_exporting():
            return None
        return _tracer.start_span("worker.request",
                                  context=tracing.context_from_headers(new.trace_headers),
                                  attributes={"gen_ai.request.id": new.request_id})

    def _prompt_logprobs_wanted(self, step: StepInputs) -> list[tuple]:
        """The requests asking for prompt logprobs at prompt positions computed this
        step: (request id, row, top k, first and end position, its first row)."""
        batch = self.input_batch
        wanted = []
        for i, (request_id, row) in enumerate(zip(step.request_ids, step.rows)):
            k = batch.states[row].sampling_params.prompt_logprobs
            if k is None:
                continue
            start = step.starts[i]
            end = min(start + step.query_start_loc[i + 1] - step.query_start_loc[i],
                      batch.num_prompt_tokens[row] - 1)
            if end > start:
                wanted.append((request_id, row, k, start, end, step.query_start_loc[i]))
        return wanted

    def _prompt_logprobs(self, wanted: list[tuple], hidden: torch.Tensor):
        """For the requests `wanted`: the logprob of each next prompt token at the
        prompt positions computed this step (position p predicts token p + 1)."""
        if not wanted:
            return {}
        batch = self.input_batch
        hidden_idx = np.concatenate([np.arange(q, q + end - start)
                                     for _, _, _, start, end, q in wanted])
        targets = np.concatenate([batch.token_ids[row, start + 1:end + 1]
                                  for _, row, _, start, end, _ in wanted])
        num_top = [k for _, _, k, start, end, _ in wanted for _ in range(end - start)]
        logits = self.model.compute_logits(hidden[torch.from_numpy(hidden_idx)])
        logprobs = logits.float().log_softmax(-1)
        results = gather_logprobs(logprobs, torch.from_numpy(targets), num_top)
        out, offset = {}, 0
        for request_id, _, _, start, end, _ in wanted:
            out[request_id] = results[offset:offset + end - start]
            offset += end - start
        return out
