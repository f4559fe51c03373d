"""Beam search settings and score, shared by the frontend and the engine core.

A beam-search request is one engine request: its SamplingParams say when each
beam stops (max_tokens, ignore_eos, stop, stop_token_ids) and how a beam may
draw one extra candidate (temperature > 0); BeamSearch says how many beams and
how they are ranked. The engine core runs the beams (services/engine_core/
beam_search.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.common.sampling_params import MAX_LOGPROBS, SamplingParams

# Each beam's step returns its top 2 × beam_width logprobs, within MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearch:
    beam_width: int
    # Scores are cum_logprob / length ** length_penalty (vLLM's rule): > 0 favours
    # longer sequences, 0 ranks by cum_logprob alone.
    length_penalty: float = 1.0

    def validate(self, params: SamplingParams) -> None:
        """Raises InvalidArgument for a bad width, or for sampling settings that beam
        search cannot honour: beams are ranked on raw log-probabilities, so whatever
        only reshapes the sampling distribution would be silently ignored."""
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidArgument("beam_search.beam_width", f"must be in [1, {MAX_BEAM_WIDTH}]")
        if not math.isfinite(self.length_penalty):
            raise InvalidArgument("beam_search.length_penalty", "must be finite")
        refused = {
            "n": params.n != 1,
            "structured_outputs": params.structured_outputs is not None,
            "prompt_logprobs": params.prompt_logprobs is not None,
            "min_tokens": params.min_tokens > 0,
            "logit_bias": bool(params.logit_bias),
            "allowed_token_ids": bool(params.allowed_token_ids),
            "bad_words": bool(params.bad_words or params.bad_words_token_ids),
        }
        for name, bad in refused.items():
            if bad:
                what = ("is the beam width with beam search; leave n at 1 here"
                        if name == "n" else "is not supported with beam search")
                raise InvalidArgument(f"sampling_params.{name}", what)


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: num_tokens counts the prompt and the output,
    a final EOS excluded."""
    return cum_logprob / (max(1, num_tokens) ** length_penalty)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (the offline LLM.beam_search's settings), with
    stop and stop_token_ids besides, which end a beam as they end a sequence."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # 0: the beams are the most likely continuations. > 0: each beam also draws a
    # token at this temperature, which competes with them (as in vLLM).
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def to_engine(self) -> tuple[SamplingParams, BeamSearch]:
        """The SamplingParams each beam stops by, and the search's own settings."""
        sampling = SamplingParams(
            max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))
        return sampling, BeamSearch(self.beam_width, self.length_penalty)
