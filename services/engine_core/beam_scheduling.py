"""The scheduler's part in beam search (beam_search.py has the search itself).

A beam group is scheduled as one unit:
- its beams decode in the same step, or none of them does;
- it is preempted whole and readmitted whole: its first live beam waits in the
  queue for all of them, and the others wait beside it, outside the queue;
- a beam's step output is kept until every live beam has one (a beam recomputed
  after a preemption samples at the end of its prompt chunks, like a decode), and
  then the group selects: pruned beams free their blocks at once, beams that go
  on take their token, and beams that split fork, sharing their parent's blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.errors import InvalidArgument
from services.common.request_events import RequestEventKind as Event
from services.common.request_types import EngineCoreOutput, FinishReason, Logprobs
from services.engine_core.beam_search import BeamGroup, BeamState, Candidate
from services.engine_core.kv_cache_manager import cdiv
from services.engine_core.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.engine_core.scheduler import _Budget


class BeamScheduling:
    """Mixed into Scheduler: the methods it calls for beams."""

    def _check_beam_group(self, first: Request) -> None:
        """Refuses a group whose beams could never all fit in the KV cache at once
        (it would wait, or preempt itself, forever)."""
        group, kv = first.beam.group, self.kv_cache_manager
        longest = min(self.max_model_len,
                      first.num_tokens + first.sampling_params.max_tokens)
        needed = group.width * cdiv(longest, kv.block_size)
        if needed > kv.num_blocks:
            raise InvalidArgument(
                "beam_search.beam_width", f"{group.width} beams of up to {longest} tokens "
                f"need {needed} KV blocks and the cache has {kv.num_blocks}: lower the beam "
                "width or max_tokens")

    def _preemption_unit(self, request: Request) -> list[Request]:
        """What preempting the request takes: itself, or its group's running beams
        (the first of them goes back to the queue)."""
        if request.beam is None:
            return [request]
        beams = request.beam.group.beams
        for beam in beams:
            beam.beam.result = None  # recomputed beams sample again
            beam.beam.known_to_workers = False
        return [b for b in beams if b.status is RequestStatus.RUNNING]

    def _has_tokens_in_flight(self, request: Request) -> bool:
        """A request preempted while its step was in flight resumes once that step is
        back (its token is in all_token_ids, which it recomputes); a beam group once
        every beam's step is."""
        beams = request.beam.group.beams if request.beam is not None else [request]
        return any(b.num_output_placeholders for b in beams)

    def _tokens_wanted(self, request: Request, budget: "_Budget",
                       decoding_groups: dict[int, bool]) -> int:
        """The tokens to ask the budget for: a beam's decode is granted only when all
        its group's decoding beams fit in this step."""
        wanted = request.num_uncomputed_tokens
        beam = request.beam
        if beam is None or wanted != 1 or len(beam.group.beams) == 1:
            return wanted
        key = id(beam.group)
        if key not in decoding_groups:
            n = sum(b.num_uncomputed_tokens == 1 for b in beam.group.beams)
            decoding_groups[key] = n <= budget.tokens and (
                budget.requests_left is None or n <= budget.requests_left)
        return 1 if decoding_groups[key] else 0

    def _workers_hold(self, request: Request) -> bool:
        """Whether the workers hold the beam's tokens and block table as they are."""
        return (request.beam.known_to_workers
                and not self.kv_cache_manager.copied_into(request.request_id))

    def _readmit_beam_group(self, group: BeamGroup) -> bool:
        """Readmits a preempted group's beams together, once the cache has room for
        all of them; they are recomputed from the next step on. False: no room."""
        kv, beams = self.kv_cache_manager, group.beams
        needed = sum(cdiv(b.num_tokens, kv.block_size) for b in beams)
        if (needed > kv.num_free_blocks
                or len(self.running) + len(beams) > self.config.max_num_seqs):
            return False
        self.waiting.pop()
        self.num_preempted -= 1
        for beam in beams:
            hits, num_cached = kv.get_computed_blocks(beam)
            kv.allocate_slots(beam, 0, hits)  # cannot fail: `needed` counts every block
            beam.num_computed_tokens = num_cached
            beam.status = RequestStatus.RUNNING
            beam.record(Event.SCHEDULED)
            self.running.append(beam)
        return True

    def _keep_beam_result(self, beam: Request, logprobs: Logprobs) -> bool:
        """Keeps a beam's step output for its group's selection; False when the
        beam was preempted while the step was in flight (it samples again)."""
        beam.num_output_placeholders -= 1
        if beam.status is not RequestStatus.RUNNING:
            return False
        beam.beam.result = logprobs
        return True

    def _advance_beam_group(self, group: BeamGroup) -> list[EngineCoreOutput]:
        """Selects the group's next beams from its beams' step outputs."""
        if group.first.num_output_tokens == 0 and not group.finished:
            group.first.record(Event.FIRST_TOKEN)
        live = []
        for parent, children in group.select(self.max_model_len):
            if not children:
                self._drop_beam(parent)
                continue
            # Forks first, from the parent as it is; then the parent takes its token.
            forks = [self._fork_beam(parent, c) for c in children[1:]]
            group.extend(parent, children[0])
            # Forks run before their parent in each step, so that they copy the
            # partial block they share and the parent then writes its own.
            position = self.running.index(parent)
            self.running[position:position] = forks
            live += forks + [parent]
        group.beams = live
        if group.is_done:
            return [self._end_beam_group(group)]
        return []

    def _fork_beam(self, parent: Request, candidate: Candidate) -> Request:
        group = parent.beam.group
        child = Request(
            request_id=group.next_beam_id(), prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params, eos_token_ids=parent.eos_token_ids,
            trace_headers=parent.trace_headers, priority=parent.priority,
            arrival_time=parent.arrival_time, status=parent.status,
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens, first_step_id=parent.first_step_id,
            output_token_ids=list(parent.output_token_ids),
            block_hashes=list(parent.block_hashes), lora_id=parent.lora_id)
        child.beam = BeamState(group, parent.beam.cum_logprob, list(parent.beam.logprobs))
        self.kv_cache_manager.fork(parent, child)
        group.extend(child, candidate)
        self.requests[child.request_id] = child
        return child

    def _drop_beam(self, beam: Request) -> None:
        """A pruned or ended beam: its blocks are freed now, the workers forget it."""
        if beam.status is RequestStatus.RUNNING:
            self.running.remove(beam)
        elif beam is beam.beam.group.beams[0]:  # waiting: the one in the queue
            self.waiting.remove(beam)
            self.num_preempted -= beam.status is RequestStatus.PREEMPTED
        beam.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(beam)
        del self.requests[beam.request_id]
        self.finished_request_ids.add(beam.request_id)

    def _end_beam_group(self, group: BeamGroup, aborted: bool = False) -> EngineCoreOutput:
        """Frees every live beam and reports the best finished ones."""
        for beam in list(group.beams):
            self._drop_beam(beam)
        group.beams = []
        del self.beam_groups[group.request_id]
        group.first.record(Event.FINISHED)
        best = [] if aborted else group.best()
        reason = FinishReason.ABORT if aborted else (
            best[0].finish_reason if best else FinishReason.LENGTH)
        return EngineCoreOutput(group.request_id, [], reason, group.first.num_cached_tokens,
                                events=group.first.events, beams=best)

