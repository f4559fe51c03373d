"""EngineCore: step = schedule -> execute on the workers -> update requests; with
async scheduling, the next step is scheduled and sent before the last one's
output is applied; with pipeline parallelism, up to P batches are in flight
(vLLM's step_with_batch_queue), each of different requests."""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from services.common import tracing
from services.common.config import EngineConfig
from services.common.errors import InvalidArgument
from services.common.lora import LoRARequest
from services.common.request_types import (EngineCoreOutput, EngineCoreRequest, EngineInfo,
                                           EngineStats)
from services.common.model_store import resolve_model
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.engine_core.beam_search import start_beam_group
from services.engine_core.executor import Executor, PendingStep
from services.engine_core.grammar import RequestGrammar
from services.engine_core.grammar_compiler import GrammarCompiler
from services.engine_core.lora_registry import LoRARegistry
from services.engine_core.request import Request
from services.engine_core.scheduler import Scheduler

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)
_tracer = tracing.tracer(__name__)


@dataclass
class _StepInFlight:
    scheduler_output: SchedulerOutput
    pending: PendingStep
    span: object  # its engine_core.step span, or None without an exporter
    sent_at: float  # time.perf_counter()


class EngineCore:
    """Transport-free engine: no threads, no gRPC. Not thread-safe."""

    def __init__(self, config: EngineConfig, executor: Executor):
        _check_speculative_config(config)
        self.config = config
        self.executor = executor
        loaded = executor.load_model(config)
        num_blocks = executor.determine_num_kv_blocks()
        self.scheduler = Scheduler(config.scheduler, config.cache, config.model.max_model_len,
                                   num_blocks, config.lora.num_slots,
                                   config.parallel.pipeline_parallel_size, config.speculative)
        executor.init_kv_cache(num_blocks)
        self.loras = LoRARegistry(config.lora, executor)
        self.info = EngineInfo(model_path=config.model.model,
                               max_model_len=config.model.max_model_len,
                               block_size=config.cache.block_size, num_kv_blocks=num_blocks,
                               dtype=loaded.dtype, vocab_size=loaded.vocab_size,
                               hidden_size=loaded.hidden_size, runner=config.model.runner)
        self.grammar_compiler = GrammarCompiler(config.model.model, loaded.vocab_size,
                                                config.structured_outputs.compile_timeout_s)
        self.num_scheduled_tokens_last_step = 0
        # Sent to the workers, output not back yet, oldest first: between step()
        # calls at most queue_depth() - 1 of them.
        self._in_flight: collections.deque[_StepInFlight] = collections.deque()
        # Batches in flight once each step was sent (the batch queue's depth).
        self.on_step_sent: Callable[[int], None] | None = None
        self._last_step_done_at = 0.0
        # Called with each step's seconds and tokens once its output is applied.
        self.on_step_done: Callable[[float, int], None] | None = None
        self._tokenizer = None  # for beam search's stop strings, loaded on use
        logger.info("engine core ready: %d KV blocks of %d tokens, dtype %s",
                    num_blocks, config.cache.block_size, loaded.dtype)

    def add_request(self, request: EngineCoreRequest,
                    compiled_grammar: xgrammar.CompiledGrammar | None = None) -> None:
        """Queues a request; raises InvalidArgument/AlreadyExists if it cannot be.
        A structured-outputs request's grammar is compiled here unless the caller
        compiled it already (the engine loop does, off its thread)."""
        params = request.sampling_params
        params.validate(self.info.vocab_size)
        if request.pooling_params is not None:
            request = self._resolve_pooling(request)
        if any(not 0 <= t < self.info.vocab_size for t in request.prompt_token_ids):
            raise InvalidArgument("prompt_token_ids",
                                  f"ids must be in [0, {self.info.vocab_size})")
        if request.lora_request is not None:
            self.loras.add(request.lora_request)
        grammar = None
        if params.structured_outputs is not None:
            compiled = compiled_grammar or self.grammar_compiler.compile(params.structured_outputs)
            grammar = RequestGrammar(compiled, request.eos_token_ids, request.output_token_ids)
        first = Request.from_engine_core_request(request, grammar)
        if request.beam_search is not None:
            request.beam_search.validate(params)
            start_beam_group(first, request.beam_search, self._stop_string_text(params))
        self.scheduler.add_request(first)

    def _stop_string_text(self, params: SamplingParams):
        """Beam search with stop strings: the text of a beam's output tokens, which
        the engine core needs to end a beam at one (the frontend cuts the text).
        The tokenizer loads on first use."""
        if not params.stop:
            return None
        if self._tokenizer is None:
            from services.common.tokenizer import load_tokenizer  # transformers: on use
            self._tokenizer, _ = load_tokenizer(resolve_model(self.config.model.model))
        tokenizer, skip = self._tokenizer, params.skip_special_tokens
        return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=skip)

    def _resolve_pooling(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """The model's pooler (ModelConfig.pooling_type, pooling_normalize) fills in
        what the request left out; then its params are checked."""
        model = self.config.model
        pooling = request.pooling_params.resolved(model.pooling_type, model.pooling_normalize)
        pooling.validate(self.info.hidden_size)
        return dataclasses.replace(request, pooling_params=pooling)

    def add_lora(self, lora: LoRARequest) -> None:
        self.loras.add(lora)

    def remove_lora(self, name: str) -> None:
        self.loras.remove(name, {r.lora_id for r in self.scheduler.requests.values()})

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_steps(self) -> int:
        return self.scheduler.num_steps

    def has_work(self) -> bool:
        """Something for step() to do: requests to run, finished ones to report,
        or a step in flight whose tokens are awaited."""
        return self._num_awaited() > 0 or self.scheduler.has_work()

    def _num_awaited(self) -> int:
        """Steps in flight that carry tokens. A step that only tells the workers
        which requests finished is not waited for: its empty output is read
        before the next step's, so a request that arrives while it travels (one
        stream's next request, just after the last one ended) is not held for
        its round trip."""
        return sum(1 for s in self._in_flight if s.scheduler_output.num_scheduled_tokens)

    def step(self) -> list[EngineCoreOutput]:
        """Schedules a step and sends it to the workers, then waits for the oldest
        steps in flight until fewer than queue_depth() are, and returns their
        outputs. With async scheduling or pipeline parallelism the step just sent
        stays in flight, so the workers find it queued when they finish the one
        before: the first call of a run returns []. When nothing could be sent
        (every request is in flight), the oldest step is waited for."""
        outputs = []
        for step in self._send_and_take_due():
            outputs += self._receive(step)
        return outputs

    async def step_async(self) -> list[EngineCoreOutput]:
        """step() for an executor whose steps' outputs arrive on the running event
        loop: each output is awaited there rather than blocked on, so that the
        loop serves the engine core's clients meanwhile."""
        outputs = []
        for step in self._send_and_take_due():
            await step.pending.wait()
            outputs += self._receive(step)
        return outputs

    def _send_and_take_due(self) -> Iterator[_StepInFlight]:
        """Schedules and sends a step, then yields the oldest steps in flight, one
        at a time, until fewer than queue_depth() are left."""
        sent = self._send(self.scheduler.schedule())
        keep = self.queue_depth() - 1 if sent else max(0, self._num_awaited() - 1)
        while self._num_awaited() > keep:
            yield self._in_flight.popleft()

    def queue_depth(self) -> int:
        """Steps that may be in flight at once. Pipeline parallelism: one batch per
        stage (vLLM's batch queue), which replaces async scheduling: a request is
        in one batch at a time, so its next step cannot be sent before its token is
        back, and each stage works on another batch meanwhile. Otherwise two with
        async scheduling, else one."""
        stages = self.config.parallel.pipeline_parallel_size
        if stages > 1 and self.executor.overlaps_steps:
            return stages
        return 2 if self._overlap_steps() else 1

    def _overlap_steps(self) -> bool:
        """Async scheduling, where the workers run apart from this thread, unless
        a structured-outputs request or a beam group runs: its next bitmask (its
        next beams) needs the token in flight, so overlapped steps would leave it
        out of every other one. Nor while drafts are verified: a step's drafts
        follow the tokens the step before it emitted, and how many of those it
        computed is known only once its drafts are checked."""
        scheduler = self.scheduler
        last = self._in_flight[-1].scheduler_output if self._in_flight else None
        last_had_drafts = last is not None and bool(last.scheduled_spec_decode_tokens)
        return (self.config.scheduler.async_scheduling and self.executor.overlaps_steps
                and not last_had_drafts
                and not scheduler.spec_decoding.active(len(scheduler.running))
                and not any(r.grammar is not None or r.beam is not None
                            for r in scheduler.running))

    def _receive(self, step: _StepInFlight) -> list[EngineCoreOutput]:
        """Waits for a step's output and applies it."""
        try:
            runner_output = step.pending.result()
        except Exception:
            self._in_flight.clear()  # the workers failed: any later step is lost too
            raise
        finally:
            if step.span is not None:
                step.span.end()
        outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        self._step_done(step)
        return outputs

    def _step_done(self, step: _StepInFlight) -> None:
        """Reports the step's time: from when the workers could start it (it was
        sent and the step before it was back) to its output applied."""
        num_tokens = step.scheduler_output.total_num_scheduled_tokens
        if not num_tokens:  # one that only drops requests, read when the next is
            return
        now = time.perf_counter()
        if self.on_step_done is not None:
            self.on_step_done(now - max(step.sent_at, self._last_step_done_at), num_tokens)
        self._last_step_done_at = now

    def _send(self, scheduler_output: SchedulerOutput) -> bool:
        """Sends a non-empty step to the workers; False for an empty one."""
        self.num_scheduled_tokens_last_step = scheduler_output.total_num_scheduled_tokens
        if scheduler_output.is_empty:
            return False
        carries_tokens = self.num_scheduled_tokens_last_step > 0
        span = self._step_span(scheduler_output) if carries_tokens else None
        try:
            pending = self.executor.execute_model_async(scheduler_output)
        except Exception:
            if span is not None:
                span.end()
            raise
        self._in_flight.append(_StepInFlight(scheduler_output, pending, span,
                                             time.perf_counter()))
        if self.on_step_sent is not None and carries_tokens:
            self.on_step_sent(self._num_awaited())
        return True

    def _step_span(self, scheduler_output):
        """A span per step, from its sending to its output, linked to the requests
        it serves; None without an exporter."""
        if not tracing.is_exporting():
            return None
        requests = self.scheduler.requests
        links = [requests[r].trace_link for r in scheduler_output.num_scheduled_tokens
                 if r in requests]
        return _tracer.start_span(
            "engine_core.step", links=[link for link in links if link], attributes={
                "llmserve.step.num_requests": len(scheduler_output.num_scheduled_tokens),
                "llmserve.step.num_tokens": scheduler_output.total_num_scheduled_tokens})

    def recover_workers(self) -> None:
        """After a worker died and came back (restarted, empty): loads the model and
        the KV cache into the workers again, and requeues every unfinished request
        to be recomputed from its prompt and the tokens it already has, so that
        each goes on where it was. Raises while the workers are not back."""
        self._in_flight.clear()
        self.scheduler.requeue_all()
        self.executor.reconnect()
        self.executor.load_model(self.config)
        self.executor.init_kv_cache(self.info.num_kv_blocks)
        self.loras.reload_all()
        logger.info("workers recovered: %d requests resume by recomputation",
                    len(self.scheduler.waiting))

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache; False (and nothing done) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        spec = scheduler.spec_decoding.stats
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_preempted=scheduler.num_preempted,
            num_preemptions_total=scheduler.num_preemptions,
            num_kv_blocks=kv.num_blocks, num_used_kv_blocks=kv.num_blocks - kv.num_free_blocks,
            num_cached_kv_blocks=len(kv.block_pool.cached_blocks),
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_steps=self.num_steps,
            num_scheduled_tokens_last_step=self.num_scheduled_tokens_last_step,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos))

    def shutdown(self) -> None:
        self.grammar_compiler.close()
        self.executor.shutdown()


def _check_speculative_config(config: EngineConfig) -> None:
    """What the speculative config needs of the rest, checked before any loading."""
    spec = config.speculative
    if spec.enabled and config.parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative_config: speculative decoding runs without pipeline "
                         "parallelism (a step's drafts need the token the last stage "
                         "samples); set pipeline_parallel_size 1")
    if spec.method == "draft_model":
        from services.common.tokenizer import check_draft_tokenizer  # transformers: on use
        check_draft_tokenizer(config.model.model, spec.model)
