"""What LLM.beam_search returns, with vLLM's classes and field names
(vllm.beam_search.BeamSearchOutput / BeamSearchSequence)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.beam_search import BeamSearchParams
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class BeamSearchSequence:
    # The prompt's tokens, then the output's; a final EOS only with
    # include_stop_str_in_output (as in vLLM).
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # tokens decoded, the prompt included (as in vLLM)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def to_beam_search_output(output: RequestOutput, params: BeamSearchParams,
                          tokenizer) -> BeamSearchOutput:
    return BeamSearchOutput([_sequence(output.prompt_token_ids, c, params, tokenizer)
                             for c in output.outputs])


def _sequence(prompt_token_ids: list[int], choice: CompletionOutput, params: BeamSearchParams,
              tokenizer) -> BeamSearchSequence:
    output_ids = list(choice.token_ids)
    ended_by_eos = choice.finish_reason == "stop" and choice.stop_reason is None
    if ended_by_eos and not params.include_stop_str_in_output:
        output_ids = output_ids[:-1]
    tokens = list(prompt_token_ids) + output_ids
    return BeamSearchSequence(
        tokens=tokens, logprobs=choice.logprobs or [], cum_logprob=choice.cumulative_logprob,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
