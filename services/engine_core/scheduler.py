"""Scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill and decode phases (as in vLLM v1): each request is given
num_tokens - num_computed_tokens more tokens, capped by what the budget has left,
so a long prompt is prefilled in chunks across steps while decodes go on.
"""
from __future__ import annotations

import logging

from services.common.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from services.common.errors import InvalidArgument, ResourceExhausted, request_id_in_use
from services.common.request_events import RequestEventKind as Event
from services.common.request_types import EngineCoreOutput, FinishReason
from services.common.scheduler_output import (CachedRequestData, ModelRunnerOutput,
                                              NewRequestData, SchedulerOutput)
from services.engine_core.beam_scheduling import BeamScheduling
from services.engine_core.beam_search import BeamGroup
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.request import Request, RequestStatus
from services.engine_core.request_queue import make_request_queue
from services.engine_core.spec_decode import SpecDecoding

logger = logging.getLogger(__name__)


class Scheduler(BeamScheduling):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int, num_kv_blocks: int, max_loras: int = 0,
                 pipeline_parallel_size: int = 1,
                 speculative_config: SpeculativeConfig | None = None):
        capacity = num_kv_blocks * cache_config.block_size
        if capacity < max_model_len:
            # Otherwise one request alone could outgrow the cache and preempt itself forever.
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                             f"{max_model_len}: give it more memory (--kv-cache-gib) or lower "
                             "--max-model-len")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        # Distinct LoRA adapters the running requests may use at once (the
        # workers' slots); 0: LoRA off.
        self.max_loras = max_loras
        # With pipeline parallelism up to this many batches are in flight (the
        # engine core's batch queue); a request is in at most one of them.
        self.pipeline_parallel_size = pipeline_parallel_size
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # in admission order
        # Finished since the last schedule(): sent to workers so they drop state.
        self.finished_request_ids: set[str] = set()
        self.num_preemptions = 0
        # Steps sent (not empty ones): the last one's SchedulerOutput.step_id.
        self.num_steps = 0
        # NOTE: a counter, not a scan of `waiting`: stats are read from another
        # thread while this one changes the queues.
        self.num_preempted = 0  # waiting requests whose status is PREEMPTED
        self.beam_groups: dict[str, BeamGroup] = {}  # by the beam-search request's id
        self.spec_decoding = SpecDecoding(speculative_config or SpeculativeConfig(),
                                          max_model_len)

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.beam_groups:
            raise request_id_in_use(request.request_id)
        if request.beam is not None:
            self._check_beam_group(request)
        if request.num_prompt_tokens == 0:
            raise InvalidArgument("prompt", "is empty")
        if request.pooling_params is not None:  # prefill only: the prompt may fill it
            if request.num_tokens > self.max_model_len:
                raise InvalidArgument("prompt", f"has {request.num_tokens} tokens; max_model_len "
                                      f"is {self.max_model_len} (truncate_prompt_tokens keeps "
                                      "the last ones)")
        elif request.num_tokens >= self.max_model_len:
            raise InvalidArgument(
                "prompt", f"has {request.num_tokens} tokens (with those already generated); "
                f"max_model_len is {self.max_model_len}, which must leave room for at least "
                "one generated token")
        if len(self.waiting) + request.queue_slots > self.config.max_waiting_requests:
            raise ResourceExhausted(
                f"{len(self.waiting)} requests are already waiting (--max-waiting-requests "
                f"{self.config.max_waiting_requests}), and this one needs {request.queue_slots} "
                "places (one per choice); retry later")
        self.requests[request.request_id] = request
        if request.beam is not None:
            self.beam_groups[request.beam.group.request_id] = request.beam.group
        self.waiting.add(request)
        request.record(Event.QUEUED)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finishes the given live requests as aborted, in any state; unknown ids
        are ignored."""
        outputs = []
        for request_id in request_ids:
            if request_id in self.beam_groups:
                outputs.append(self._end_beam_group(self.beam_groups[request_id], aborted=True))
                continue
            request = self.requests.get(request_id)
            if request is None or request.beam is not None:  # a beam goes with its group
                continue
            self._dequeue(request)
            self._finish(request, FinishReason.ABORT)
            outputs.append(EngineCoreOutput(request_id, [], FinishReason.ABORT,
                                            request.num_cached_tokens, events=request.events))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run, or finished ones the workers have not been told of."""
        return bool(self.requests or self.finished_request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def requeue_all(self) -> None:
        """The workers lost their KV cache (one was restarted): every running
        request goes back to wait, to be recomputed as after a preemption, and
        the prefix cache forgets blocks whose contents are gone."""
        for request in reversed(list(self.running)):  # prepended: they keep their order
            if request.status is RequestStatus.RUNNING:  # not preempted with its beam group
                self._preempt(request)
        self.finished_request_ids.clear()  # the new workers never saw them
        for request in self.requests.values():  # the steps in flight are lost
            request.num_output_placeholders = 0
        self.kv_cache_manager.reset_prefix_cache()


    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. With async scheduling it may be called again before the
        last step's output is back: each request's in-flight sampled tokens are
        placeholders, which the next step computes as the workers know them."""
        output = SchedulerOutput(step_id=self.next_step_id,
                                 finished_request_ids=sorted(self.finished_request_ids))
        self.finished_request_ids.clear()
        budget = _Budget(self.config.max_num_batched_tokens, self._prefill_cap(),
                         self._batch_request_cap())
        preempted = self._schedule_running(output, budget)
        if not preempted:  # no room to admit anyone when running requests lacked blocks
            self._schedule_waiting(output, budget)
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            num_drafts = len(output.scheduled_spec_decode_tokens.get(request_id, ()))
            if num_new - num_drafts != 1 or request.num_uncomputed_tokens != 1:
                request.record(Event.PREFILL_CHUNK, num_new)  # not a decode
            request.num_computed_tokens += num_new
            # Drafts are computed past the known tokens: then it is below 0.
            if request.num_uncomputed_tokens <= 0 and request.pooling_params is None:
                # It samples this step (a pooling request's step pools instead).
                if request.grammar is not None:  # the tokens its grammar allows next
                    output.grammar_bitmasks[request_id] = self._grammar_bitmask(
                        request, output.scheduled_spec_decode_tokens.get(request_id))
                if self.spec_decoding.enabled and \
                        self.spec_decoding.wants_drafts(request, len(self.running)):
                    output.requests_to_draft.append(request_id)
                request.num_output_placeholders += 1
        output.blocks_to_copy = self.kv_cache_manager.take_blocks_to_copy()
        if not output.is_empty:  # the engine core sends it
            self.num_steps += 1
        return output

    @property
    def next_step_id(self) -> int:
        return self.num_steps + 1

    def _batch_request_cap(self) -> int | None:
        """Pipeline parallelism: requests one batch may hold, a 1/P share of the live
        ones, so that P batches fill the pipeline. Without it the first batch would
        take every running request and the next find none left to run."""
        if self.pipeline_parallel_size == 1:
            return None
        live = len(self.running) + len(self.waiting)
        return max(1, -(-live // self.pipeline_parallel_size))

    def _prefill_cap(self) -> int | None:
        """How many prompt tokens this step may compute, if capped (see
        SchedulerConfig.max_step_tokens_while_decoding)."""
        step_tokens = self.config.max_step_tokens_while_decoding
        num_decoding = sum(r.num_uncomputed_tokens == 1 for r in self.running)
        # The cap trades waiting prompts' first tokens for the decodes' next ones:
        # not while more prompts wait than requests decode (a burst's start, where
        # the one request that came first would hold back all the others).
        if not step_tokens or not num_decoding or len(self.waiting) > num_decoding:
            return None
        # A step costs about its token count, so bounding the count bounds every
        # decode's wait (at 64 decodes, a flat 256-token prefill cap made steps
        # 2.6-3.1x a decode step; this rule 2.6-2.7x, throughput alike). The
        # floor keeps prompts moving when hundreds of requests decode.
        return max(step_tokens - num_decoding, step_tokens // 4)

    def _schedule_running(self, output: SchedulerOutput, budget: "_Budget") -> bool:
        """Schedules running requests; True when one had to be preempted."""
        scheduled: dict[str, NewRequestData | CachedRequestData] = {}
        visited: set[str] = set()  # running requests looked at: a prefix of running
        decoding_groups: dict[int, bool] = {}  # beam groups: whether they decode now
        preempted = False
        index = 0
        while index < len(self.running) and budget.tokens > 0:
            request = self.running[index]
            visited.add(request.request_id)
            if self._waits_for_in_flight_tokens(request):
                index += 1
                continue
            if budget.requests_left == 0:
                break
            wanted = self._tokens_wanted(request, budget, decoding_groups)
            drafts = self.spec_decoding.drafts_to_verify(request, len(self.running)) \
                if wanted == 1 else []
            num_new = budget.grant(request.request_id, wanted + len(drafts), len(drafts))
            if num_new == 0:  # a prompt chunk, and the prefill cap is spent
                index += 1
                continue
            lookahead = self.spec_decoding.num_lookahead_tokens if wanted == 1 else 0
            num_new, new_block_ids, victims = self._allocate_step(request, num_new, wanted,
                                                                  budget, lookahead)
            for victim in victims:  # undo their places in this step
                if scheduled.pop(victim.request_id, None) is not None:
                    output.num_scheduled_tokens.pop(victim.request_id)
                    output.scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    budget.refund(victim.request_id)
            if new_block_ids is None:  # `request` itself was preempted
                budget.refund(request.request_id)
            else:
                scheduled[request.request_id] = self._step_data(request, new_block_ids)
                output.num_scheduled_tokens[request.request_id] = num_new
                if num_new > wanted:  # the drafts the budget had room for
                    output.scheduled_spec_decode_tokens[request.request_id] = \
                        drafts[:num_new - wanted]
            if victims:
                preempted = True
                index = sum(r.request_id in visited for r in self.running)
            else:
                index += 1
        output.new_requests += [d for d in scheduled.values() if isinstance(d, NewRequestData)]
        output.cached_requests = [d for d in scheduled.values()
                                  if isinstance(d, CachedRequestData)]
        return preempted

    def _allocate_step(self, request: Request, num_new: int, wanted: int, budget: "_Budget",
                       lookahead: int = 0) -> tuple[int, list[int] | None, list[Request]]:
        """_allocate_preempting for num_new tokens, of which those past `wanted` are
        drafts, and `lookahead` slots more for a draft model's next drafts. These
        never preempt anyone: without room for them the request runs without them.
        Returns the tokens it runs, too."""
        if num_new > wanted or lookahead:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new + lookahead)
            if new_block_ids is not None:
                return num_new, new_block_ids, []
            num_new = budget.shrink(request.request_id, wanted)
        return (num_new, *self._allocate_preempting(request, num_new))

    def _allocate_preempting(self, request: Request,
                             num_new: int) -> tuple[list[int] | None, list[Request]]:
        """allocate_slots, preempting requests (the latest first, or by priority)
        until it succeeds or `request` itself is preempted (then None). Also
        returns every request preempted."""
        victims: list[Request] = []
        new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
        while new_block_ids is None:
            preempted = self._preempt(self._pick_victim())
            victims += preempted
            if request in preempted:
                break
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
        return new_block_ids, victims

    def _step_data(self, request: Request,
                   new_block_ids: list[int]) -> NewRequestData | CachedRequestData:
        """What the workers are told of a scheduled running request. A beam they do
        not hold as it is (a fork, or one whose partial block was just copied) is
        sent whole."""
        if request.beam is not None and not self._workers_hold(request):
            return self._new_request_data(request, request.num_computed_tokens)
        return CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens,
                                 self._tokens_workers_lack(request))

    def _schedule_waiting(self, output: SchedulerOutput, budget: "_Budget") -> None:
        # Requests whose LoRA adapter has no free slot keep their place; the ones
        # behind them go first meanwhile (as in vLLM).
        skipped: list[Request] = []
        while (self.waiting and budget.tokens > 0 and budget.prefill_left != 0
               and budget.requests_left != 0 and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            # A request preempted while its step was in flight resumes once that
            # step's token is in its output (all_token_ids is what it recomputes).
            if not self._lora_slot_free(request) or self._has_tokens_in_flight(request):
                skipped.append(self.waiting.pop())
            elif not self._admit(request, output, budget):
                break  # no KV room for the head: nothing behind it jumps ahead
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _admit(self, request: Request, output: SchedulerOutput, budget: "_Budget") -> bool:
        """Schedules the waiting queue's head; False when the KV cache has no room."""
        if request.beam is not None and len(request.beam.group.beams) > 1:
            return self._readmit_beam_group(request.beam.group)
        kv = self.kv_cache_manager
        computed_blocks, num_cached = kv.get_computed_blocks(request)
        num_new = budget.grant(request.request_id, request.num_tokens - num_cached)
        if kv.allocate_slots(request, num_new, computed_blocks) is None:
            budget.refund(request.request_id)
            return False
        self.waiting.pop()
        kv.record_prefix_cache_lookup(request.num_tokens, num_cached)
        self.running.append(request)
        if request.status is RequestStatus.WAITING:  # not a resumed preemption
            request.num_cached_tokens = num_cached
            request.first_step_id = output.step_id
        else:
            self.num_preempted -= 1
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        request.record(Event.SCHEDULED)
        output.new_requests.append(self._new_request_data(request, num_cached))
        output.num_scheduled_tokens[request.request_id] = num_new
        return True

    def _new_request_data(self, request: Request, num_computed: int) -> NewRequestData:
        if request.beam is not None:
            request.beam.known_to_workers = True
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.block_ids(request.request_id),
            num_computed_tokens=num_computed,
            trace_headers=request.trace_headers,
            eos_token_ids=[] if request.sampling_params.ignore_eos
            else sorted(request.eos_token_ids),
            num_prompt_tokens=request.num_prompt_tokens, lora_id=request.lora_id,
            pooling_params=request.pooling_params)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop conditions, frees finished requests."""
        outputs = []
        finished = False
        beam_groups: dict[int, BeamGroup] = {}  # those whose beams sampled
        starts = {r.request_id: r.num_computed_tokens
                  for r in (*scheduler_output.new_requests, *scheduler_output.cached_requests)}
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            # Aborted or finished since; or, with async scheduling, finished and
            # followed by a new request under the same id.
            if request is None or request.first_step_id > scheduler_output.step_id:
                continue
            pooled = runner_output.pooled.get(request_id)
            if pooled is not None:  # its prompt is computed: a pooling request is done
                outputs.append(self._finish_pooled(request, pooled))
                finished = True
                continue
            token_ids = runner_output.sampled_token_ids.get(request_id)
            prompt_logprobs = self._new_prompt_logprobs(
                request, starts[request_id], num_scheduled,
                runner_output.prompt_logprobs.get(request_id, []))
            if token_ids is None:  # a partial prefill chunk
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(request_id, [], None, request.num_cached_tokens,
                                                    prompt_logprobs=prompt_logprobs))
                continue
            if request.beam is not None:  # its group chooses the tokens, below
                if self._keep_beam_result(request, runner_output.logprobs[request_id][0]):
                    beam_groups[id(request.beam.group)] = request.beam.group
                continue
            request.num_output_placeholders -= 1
            self._settle_drafts(request, scheduler_output.scheduled_spec_decode_tokens.get(
                request_id, ()), len(token_ids) - 1)
            outputs.append(self._take_tokens(request, token_ids, runner_output, prompt_logprobs))
            finished |= request.is_finished
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        for group in beam_groups.values():
            if group.all_results_in():
                outputs += self._advance_beam_group(group)
        return outputs

    # ---- internals -------------------------------------------------------------

    def _take_tokens(self, request: Request, token_ids: list[int],
                     runner_output: ModelRunnerOutput, prompt_logprobs: list
                     ) -> EngineCoreOutput:
        """Appends a step's tokens to the request, finishes it if one ends it, and
        keeps the drafts proposed for its next step."""
        token_ids, reason = self._append_output_tokens(request, token_ids)
        if reason is not None:
            if request.status is RequestStatus.PREEMPTED:  # while its step was in flight
                self._dequeue(request)
            self._finish(request, reason)
        else:  # drafts to follow the tokens it has now
            request.spec_token_ids = runner_output.spec_token_ids.get(request.request_id, [])
        logprobs = runner_output.logprobs.get(request.request_id, [])
        output = EngineCoreOutput(request.request_id, token_ids, reason,
                                  request.num_cached_tokens,
                                  new_logprobs=logprobs[:len(token_ids)],
                                  prompt_logprobs=prompt_logprobs)
        if reason is not None:
            output.events = request.events
            acceptance = request.draft_acceptance
            output.num_draft_tokens = acceptance.num_draft_tokens
            output.num_accepted_tokens = acceptance.num_accepted
            output.num_drafts = acceptance.num_steps
        return output

    @staticmethod
    def _grammar_bitmask(request: Request, drafts: list[int] | None):
        """The bitmask of its next token; with drafts, one per position verified."""
        if drafts:
            return request.grammar.draft_bitmasks(drafts)
        return request.grammar.next_token_bitmask()

    def _append_output_tokens(self, request: Request, token_ids: list[int]
                              ) -> tuple[list[int], FinishReason | None]:
        """Appends a step's tokens up to the first that ends the request (those
        after it are dropped); returns the ones appended and the finish reason."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if request.num_output_tokens == 1:
                request.record(Event.FIRST_TOKEN)
            reason = request.stop_reason_after_last_token(self.max_model_len)
            if reason is not None:
                return token_ids[:i + 1], reason
        return token_ids, None

    def _settle_drafts(self, request: Request, drafts, num_accepted: int) -> None:
        """After a step that verified drafts: the rejected ones' KV is not the
        request's, so its computed tokens end after the accepted ones, and the
        blocks that held only rejected tokens are freed."""
        if drafts:  # counted even for a request preempted meanwhile
            self.spec_decoding.verified(request, len(drafts), num_accepted)
        if not self.spec_decoding.enabled or request.status is not RequestStatus.RUNNING:
            return  # a preempted request recomputes from 0 anyway
        if drafts:
            request.num_computed_tokens -= len(drafts) - num_accepted
        # Also a draft model's lookahead slots, which the workers are done with.
        self.kv_cache_manager.free_tail(request, request.num_computed_tokens)

    def _finish_pooled(self, request: Request, pooled: list[float]) -> EngineCoreOutput:
        """A pooling request ends with its vector and no token; its blocks are freed now."""
        if request.status is RequestStatus.PREEMPTED:  # while its last step was in flight
            self._dequeue(request)
        self._finish(request, FinishReason.STOP)
        return EngineCoreOutput(request.request_id, [], FinishReason.STOP,
                                request.num_cached_tokens, events=request.events, pooled=pooled)

    @staticmethod
    def _new_prompt_logprobs(request: Request, start: int, num_scheduled: int,
                             chunk: list) -> list:
        """Drops prompt logprobs already reported before a preemption made the
        request recompute its prompt. chunk[j] is for prompt token start + 1 + j."""
        if not chunk:
            return chunk
        chunk = chunk[max(0, request.num_prompt_logprobs_reported - start):]
        request.num_prompt_logprobs_reported = max(request.num_prompt_logprobs_reported,
                                                   start + num_scheduled)
        return chunk

    def _waits_for_in_flight_tokens(self, request: Request) -> bool:
        """Async scheduling: whether the request sits this step out until its
        in-flight tokens are back. A structured-outputs request needs them for
        its grammar's next bitmask (EngineCore never overlaps steps while one
        runs, so there this only guards the scheduler's own rule); one they take
        to its length limit is done. With pipeline parallelism every request
        waits (vLLM's rule): the first stage needs the token as its input, and
        only the last stage has it."""
        return request.num_output_placeholders > 0 and (
            self.pipeline_parallel_size > 1 or request.grammar is not None
            or request.beam is not None  # its group's next tokens depend on them
            or request.in_flight_tokens_end_it(self.max_model_len))

    def _tokens_workers_lack(self, request: Request) -> list[int]:
        """Pipeline parallelism: the output tokens a scheduled cached request sends
        (see CachedRequestData.new_token_ids); none otherwise, where the workers
        append what they sample."""
        if self.pipeline_parallel_size == 1 and request.beam is None:
            return []  # beams: the workers sampled a token, the group chose another
        start = max(request.num_computed_tokens, request.num_prompt_tokens)
        return list(request.all_token_ids[start:])

    def _lora_slot_free(self, request: Request) -> bool:
        """Whether admitting the request keeps the running adapters within max_loras."""
        if not request.lora_id:
            return True
        running = {r.lora_id for r in self.running if r.lora_id}
        return request.lora_id in running or len(running) < self.max_loras

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted; priority: the lowest priority (highest
        value), then the latest arrival."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _dequeue(self, request: Request) -> None:
        """Takes a live request out of `running` or `waiting`, wherever it is."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self.num_preempted -= request.status is RequestStatus.PREEMPTED

    def _preempt(self, request: Request) -> list[Request]:
        """Preempts a running request, or the whole beam group of a beam, to be
        recomputed; returns the requests taken out of `running`."""
        unit = self._preemption_unit(request)
        for r in unit:
            self.running.remove(r)
            self.kv_cache_manager.free(r)
            r.status = RequestStatus.PREEMPTED
            r.record(Event.PREEMPTED, r.num_tokens)
            r.num_computed_tokens = 0
        self.num_preempted += 1
        self.waiting.prepend(unit[0])  # a beam group's other beams wait with it
        self.num_preemptions += 1
        logger.info("preempted request %s (%d tokens) to free KV blocks",
                    request.request_id, sum(r.num_tokens for r in unit))
        return unit

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.record(Event.FINISHED)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_request_ids.add(request.request_id)


class _Budget:
    """One step's token budget, and the part of it prompt tokens may use."""

    def __init__(self, tokens: int, prefill_cap: int | None, request_cap: int | None = None):
        self.tokens = tokens
        self.prefill_left = prefill_cap  # None: uncapped
        self.requests_left = request_cap  # None: uncapped
        self._granted: dict[str, tuple[int, int]] = {}  # request -> (tokens, prefill part)

    def grant(self, request_id: str, wanted: int, num_drafts: int = 0) -> int:
        """Tokens given to a request wanting `wanted` more (1: a decode, which the
        prefill cap never limits, nor a decode's drafts)."""
        granted = min(wanted, self.tokens)
        prefill = 0
        if wanted - num_drafts > 1 and self.prefill_left is not None:
            granted = prefill = min(granted, self.prefill_left)
            self.prefill_left -= prefill
        self.tokens -= granted
        self._granted[request_id] = (granted, prefill)
        if granted and self.requests_left is not None:
            self.requests_left -= 1
        return granted

    def shrink(self, request_id: str, tokens: int) -> int:
        """Takes back what a request was granted beyond `tokens` (drafts only, which
        the prefill cap never counts); returns `tokens`."""
        granted, prefill = self._granted[request_id]
        self.tokens += granted - tokens
        self._granted[request_id] = (tokens, prefill)
        return tokens

    def refund(self, request_id: str) -> None:
        """Gives back what a request was granted but could not use."""
        tokens, prefill = self._granted.pop(request_id)
        self.tokens += tokens
        if self.prefill_left is not None:
            self.prefill_left += prefill
        if tokens and self.requests_left is not None:
            self.requests_left += 1
