"""Beam search inside the engine core, as vLLM v0 ran it (the seeds' `use_beam_search`
and `blocks_to_copy`), on our block pool's reference counts.

A BeamGroup is one beam-search request. Each live beam is a Request of its own
("<id>#<k>") with its own block table; a beam that splits shares every block
with its parent (KVCacheManager.fork) and only the partial last block is copied,
by the workers, when it is first written. No prompt is recomputed.

Each step every live beam returns its top 2 × beam_width raw logprobs (and, at
temperature > 0, the token it drew). select() then applies transformers' rule
(generate(num_beams=k, early_stopping=True)): of the 2k best continuations by
cumulative logprob, a finished one (EOS, a stop token or string, the length
limit) counts only if it ranks among the first k; the best k unfinished ones go
on. The group ends once k beams have finished, or none is left to go on.
Finished beams are ranked by vLLM's length-penalized score (beam_score).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from services.common.beam_search import BeamSearch, beam_score
from services.common.request_types import BeamSequence, FinishReason, Logprobs

if TYPE_CHECKING:
    from services.engine_core.request import Request


@dataclass(eq=False)
class BeamState:
    """What a Request needs to be a beam."""

    group: "BeamGroup"
    cum_logprob: float = 0.0
    # Of its output tokens, for the caller (empty unless logprobs were asked for).
    logprobs: list[Logprobs] = field(default_factory=list)
    # The logprobs its last step returned, until the group's next selection.
    result: Logprobs | None = None
    # False while the workers do not hold this beam as it is: a fork not sent yet,
    # or a beam whose block table a copy changed. It is then sent whole.
    known_to_workers: bool = False


@dataclass
class Candidate:
    beam: "Request"
    token_id: int
    logprob: float
    rank: int  # of token_id in the beam's distribution, 1 = the most likely
    cum_logprob: float  # the beam's with this token
    result: Logprobs  # the beam's step, whose top tokens the caller may see


class BeamGroup:
    def __init__(self, request_id: str, search: BeamSearch, first: "Request",
                 num_logprobs: int | None,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.request_id = request_id
        self.width = search.beam_width
        self.length_penalty = search.length_penalty
        self.num_logprobs = num_logprobs  # what the caller asked for per token
        # Text of output tokens; needed only to find stop strings.
        self.detokenize = detokenize
        self.beams: list[Request] = [first]  # live ones
        self.finished: list[BeamSequence] = []
        # The group's first beam: its events are the group's lifecycle.
        self.first = first
        self._ids = itertools.count(1)
        first.beam = BeamState(self)

    def next_beam_id(self) -> str:
        return f"{self.request_id}#{next(self._ids)}"

    @property
    def is_done(self) -> bool:
        """transformers' early_stopping=True: k finished beams end the search."""
        return len(self.finished) >= self.width or not self.beams

    def all_results_in(self) -> bool:
        return all(beam.beam.result is not None for beam in self.beams)

    def select(self, max_model_len: int) -> list[tuple["Request", list[Candidate]]]:
        """Ranks the live beams' continuations; finished ones join self.finished.
        Returns each live beam with the continuations that go on from it (none:
        it is pruned). Clears the beams' results."""
        ranked = sorted((c for beam in self.beams for c in self._candidates(beam)),
                        key=lambda c: c.cum_logprob, reverse=True)[:2 * self.width]
        children: dict[int, list[Candidate]] = {id(beam): [] for beam in self.beams}
        num_live = 0
        for rank, candidate in enumerate(ranked):
            reason, stop_reason = self._finish_reason(candidate, max_model_len)
            if reason is not None:
                if rank < self.width:
                    self.finished.append(self._finished(candidate, reason, stop_reason))
            elif num_live < self.width:
                children[id(candidate.beam)].append(candidate)
                num_live += 1
        for beam in self.beams:
            beam.beam.result = None
        return [(beam, children[id(beam)]) for beam in self.beams]

    def extend(self, beam: "Request", candidate: Candidate) -> None:
        """The beam goes on with the candidate's token."""
        state = beam.beam
        state.cum_logprob = candidate.cum_logprob
        if self.num_logprobs is not None:
            state.logprobs.append(self._logprobs(candidate))
        beam.append_output_token(candidate.token_id)

    def best(self) -> list[BeamSequence]:
        return sorted(self.finished, key=lambda b: b.score, reverse=True)[:self.width]

    def _candidates(self, beam: "Request") -> list[Candidate]:
        result, cum = beam.beam.result, beam.beam.cum_logprob
        top = zip(result.top_token_ids[:2 * self.width], result.top_logprobs[:2 * self.width])
        out = [Candidate(beam, t, lp, rank, cum + lp, result)
               for rank, (t, lp) in enumerate(top, start=1)]
        if result.token_id not in result.top_token_ids[:2 * self.width]:
            # temperature > 0: the token the beam drew competes too (as in vLLM).
            out.append(Candidate(beam, result.token_id, result.logprob, result.rank,
                                 cum + result.logprob, result))
        return out

    def _finish_reason(self, c: Candidate, max_model_len: int):
        """(FinishReason, stop reason) if the continuation ends its beam, else (None, None)."""
        beam, params = c.beam, c.beam.sampling_params
        if c.token_id in params.stop_token_ids:
            return FinishReason.STOP, c.token_id
        if c.token_id in beam.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if params.stop and self.detokenize is not None:
            text = self.detokenize(beam.output_token_ids + [c.token_id])
            stop = next((s for s in params.stop if s in text), None)
            if stop is not None:
                return FinishReason.STOP, stop
        if beam.at_length_limit(max_model_len, 1):
            return FinishReason.LENGTH, None
        return None, None

    def _finished(self, c: Candidate, reason: FinishReason, stop_reason) -> BeamSequence:
        beam = c.beam
        tokens = beam.output_token_ids + [c.token_id]
        ends_in_eos = reason is FinishReason.STOP and stop_reason is None
        length = beam.num_prompt_tokens + len(tokens) - ends_in_eos
        logprobs = beam.beam.logprobs + [self._logprobs(c)] if self.num_logprobs is not None else []
        return BeamSequence(tokens, c.cum_logprob,
                            beam_score(length, c.cum_logprob, self.length_penalty),
                            reason, stop_reason, logprobs)

    def _logprobs(self, c: Candidate) -> Logprobs:
        """The caller's view of the chosen token: its logprob and the top ones it asked for."""
        k = self.num_logprobs
        return Logprobs(c.token_id, c.logprob, c.rank, c.result.top_token_ids[:k],
                        c.result.top_logprobs[:k])


def start_beam_group(first: "Request", search: BeamSearch,
                     detokenize: Callable[[list[int]], str] | None) -> BeamGroup:
    """Makes a new request the first beam of its group: it runs as "<id>#0" and
    its steps return the top 2 × beam_width logprobs that selection ranks."""
    params = first.sampling_params
    group = BeamGroup(first.request_id, search, first, params.logprobs, detokenize)
    first.request_id = f"{group.request_id}#0"
    first.sampling_params = dataclasses.replace(
        params, logprobs=max(2 * search.beam_width, params.logprobs or 0))
    return group
