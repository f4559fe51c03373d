"""What the offline API returns, with vLLM's classes, field names and types
(vllm.outputs.RequestOutput / CompletionOutput, vllm.logprobs.Logprob), so code
written for vLLM reads them unchanged. `to_request_output` is the one place where
the frontend's own types become these."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.request_types import Logprobs
from services.frontend.choice import ChoiceOutput
from services.frontend.output_processor import GenerationOutput


@dataclass
class Logprob:
    """The log-probability of one token at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per generated position: token id -> Logprob, the chosen token first, then the
# top ones. Per prompt position the same, None at the first.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # The stop string or stop token id that ended it; None for EOS and length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


def to_request_output(output: GenerationOutput) -> RequestOutput:
    """The frontend's GenerationOutput in vLLM's shape."""
    prompt_logprobs = None
    if output.prompt_logprobs is not None:
        prompt_logprobs = [None] + [_position(lp) for lp in output.prompt_logprobs]
    return RequestOutput(
        request_id=output.request_id, prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids, prompt_logprobs=prompt_logprobs,
        outputs=[_completion(c) for c in output.outputs], finished=output.finished,
        num_cached_tokens=output.num_cached_tokens)


def _completion(choice: ChoiceOutput) -> CompletionOutput:
    return CompletionOutput(
        index=choice.index, text=choice.text, token_ids=choice.token_ids,
        cumulative_logprob=choice.cumulative_logprob,
        logprobs=None if choice.logprobs is None else [_position(lp) for lp in choice.logprobs],
        finish_reason=None if choice.finish_reason is None else str(choice.finish_reason),
        stop_reason=choice.stop_reason)


def _position(lp: Logprobs) -> dict[int, Logprob]:
    entries = {lp.token_id: Logprob(lp.logprob, lp.rank, lp.token)}
    for rank, (token_id, logprob, text) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, lp.top_tokens), start=1):
        entries.setdefault(token_id, Logprob(logprob, rank, text))
    return entries
