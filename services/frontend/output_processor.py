"""OutputProcessor: turns engine-core outputs into what callers see, per request.

Transport-free and synchronous, like vLLM v1's OutputProcessor: AsyncLLM (which
the gRPC and HTTP servers adapt) and the offline LLMEngine both feed it engine
outputs and get GenerationOutputs back. It owns the n choices of each request,
their detokenization, stop strings (and which engine requests to abort for
them), logprob texts and the output kinds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.request_types import EngineCoreOutput, Logprobs
from services.common.sampling_params import OutputKind, SamplingParams
from services.frontend.choice import ChoiceOutput, ChoiceState
from services.frontend.detokenizer import IncrementalDetokenizer, add_token_texts
from services.frontend.metrics import FrontendMetrics


@dataclass
class GenerationOutput:
    """What a batch of engine outputs changed for one request."""

    request_id: str
    prompt: str | None  # the prompt text, when the input was text
    prompt_token_ids: list[int]
    # The choices reported now. DELTA and CUMULATIVE: those that changed;
    # FINAL_ONLY: all n, once, when the last one finishes.
    outputs: list[ChoiceOutput]
    # Logprobs of every prompt position after the first, when asked for. They
    # follow the output kind: DELTA sends them once, with the request's first
    # output (None after that); CUMULATIVE and FINAL_ONLY with every output.
    prompt_logprobs: list[Logprobs] | None
    finished: bool  # every choice has finished
    num_cached_tokens: int


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[ChoiceState]
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    # Beam search: one engine request, whose last output finishes every choice.
    beam_search: bool = False
    _sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def make_output(self, reported: dict[int, ChoiceOutput]) -> GenerationOutput | None:
        """The output for choices that reported in this batch, if there is one."""
        kind = self.params.output_kind
        if kind is OutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            reported = {c.index: c.final_output() for c in self.choices}
        if not reported:
            return None
        return GenerationOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[reported[i] for i in sorted(reported)],
            prompt_logprobs=self._prompt_logprobs_to_send(kind), finished=self.finished,
            num_cached_tokens=self.choices[0].num_cached_tokens)

    def _prompt_logprobs_to_send(self, kind: OutputKind) -> list[Logprobs] | None:
        if self.params.prompt_logprobs is None:
            return None
        if kind is OutputKind.DELTA and self._sent_prompt_logprobs:
            return None
        self._sent_prompt_logprobs = True
        return list(self.prompt_logprobs)


@dataclass
class ProcessedOutputs:
    outputs: list[GenerationOutput]
    # Engine requests whose choice a stop string ended: abort them in the engine.
    engine_ids_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer, metrics: FrontendMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics  # told of tokens, finished choices and engine events
        self.requests: dict[str, RequestState] = {}
        # Engine request id -> (its request, choice index).
        self._choice_of: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, engine_request_ids: list[str],
                    arrival_time: float | None = None, beam_width: int = 0) -> RequestState:
        """Starts tracking a request whose n choices are the given engine requests,
        or, with a beam_width, whose beams the one engine request returns.
        arrival_time (time.monotonic()) dates its timings; default: now."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if beam_width:
            engine_request_ids = engine_request_ids * beam_width
        choices = [ChoiceState(i, engine_id, params, IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens), arrival_time=arrival_time)
            for i, engine_id in enumerate(engine_request_ids)]
        state = RequestState(request_id, prompt, prompt_token_ids, params, choices,
                             beam_search=beam_width > 0)
        self.requests[request_id] = state
        for choice in reversed(choices):  # beam search: all one engine id, choice 0's
            self._choice_of[choice.engine_request_id] = (state, choice.index)
        return state

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Applies a batch of engine outputs: one GenerationOutput per request that has
        something to report. Finished requests are forgotten."""
        reported: dict[str, dict[int, ChoiceOutput]] = {}
        to_abort = []
        for engine_output in engine_outputs:
            if self.metrics is not None and engine_output.events:
                self.metrics.on_engine_events(engine_output.events)
            state, index = self._choice_of.get(engine_output.request_id, (None, 0))
            if state is None:  # aborted, or its choice already ended by a stop string
                continue
            changes = reported.setdefault(state.request_id, {})
            for i, output in _per_choice(state, index, engine_output):
                choice_output = self._apply_and_measure(state, i, output)
                if choice_output is not None:
                    changes[i] = choice_output
                if state.choices[i].stopped_by_string:
                    to_abort.append(engine_output.request_id)
        outputs = []
        for request_id, changes in reported.items():
            state = self.requests[request_id]
            output = state.make_output(changes)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self._forget(state)
        return ProcessedOutputs(outputs, to_abort)

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns the engine ids of its unfinished choices."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        self._forget(state)
        # dict.fromkeys: a beam-search request's choices share one engine id.
        return list(dict.fromkeys(c.engine_request_id for c in state.choices if not c.finished))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _apply_and_measure(self, state: RequestState, index: int,
                           engine_output: EngineCoreOutput) -> ChoiceOutput | None:
        choice = state.choices[index]
        if self.metrics is None or choice.finished:  # tokens after a stop string do not count
            return self._apply(state, index, engine_output)
        previous_token_time = choice.last_token_time
        output = self._apply(state, index, engine_output)
        if engine_output.new_token_ids:
            self.metrics.on_tokens(choice, len(engine_output.new_token_ids), previous_token_time)
        if choice.finished:
            self.metrics.on_finished(choice, len(state.prompt_token_ids))
        return output

    def _apply(self, state: RequestState, index: int,
               engine_output: EngineCoreOutput) -> ChoiceOutput | None:
        if index == 0 and engine_output.prompt_logprobs:
            add_token_texts(self.tokenizer, engine_output.prompt_logprobs)
            state.prompt_logprobs += engine_output.prompt_logprobs
        return state.choices[index].update(engine_output)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for choice in state.choices:
            self._choice_of.pop(choice.engine_request_id, None)


def _per_choice(state: RequestState, index: int,
                engine_output: EngineCoreOutput) -> list[tuple[int, EngineCoreOutput]]:
    """The engine output as each choice it concerns sees it. A beam-search request's
    only output finishes every choice: choice i with beam i (the best first), and
    choices beyond the beams that finished are dropped."""
    if not state.beam_search:
        return [(index, engine_output)]
    beams = engine_output.beams
    if not beams:  # aborted
        return [(choice.index, engine_output) for choice in state.choices]
    del state.choices[len(beams):]
    for choice, beam in zip(state.choices, beams):
        choice.beam_cumulative_logprob = beam.cum_logprob
    return [(i, EngineCoreOutput(engine_output.request_id, beam.token_ids, beam.finish_reason,
                                 engine_output.num_cached_tokens, new_logprobs=beam.logprobs))
            for i, beam in enumerate(beams)]
