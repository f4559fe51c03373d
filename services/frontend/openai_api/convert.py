"""OpenAI request bodies -> the frontend's inputs and SamplingParams, and its
outputs -> OpenAI response pieces. The only place HTTP bodies are converted."""
from __future__ import annotations

from services.common.beam_search import MAX_BEAM_WIDTH, BeamSearch
from services.common.errors import InvalidArgument
from services.common.request_types import Logprobs
from services.common.sampling_params import OutputKind, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.async_llm import PromptInput
from services.frontend.choice import ChoiceOutput
from services.frontend.openai_api import protocol as P
from services.frontend.processor import ChatMessage


def sampling_params(request: P.SamplingFields, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's sampling fields; streamed requests get DELTA outputs, others
    one FINAL_ONLY output per choice."""
    optional = {"temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "min_p": request.min_p,
                "repetition_penalty": request.repetition_penalty}
    return SamplingParams(
        n=1 if request.use_beam_search else request.n,  # with beam search n is its width
        max_tokens=max_tokens, seed=request.seed, stop=request.stop,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=_logit_bias(request.logit_bias), logprobs=logprobs,
        min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        stop_token_ids=request.stop_token_ids, allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words, structured_outputs=_structured_outputs(request),
        output_kind=OutputKind.DELTA if request.stream else OutputKind.FINAL_ONLY,
        **{k: v for k, v in optional.items() if v is not None})


def beam_search(request: P.SamplingFields) -> BeamSearch | None:
    """vLLM's use_beam_search: n beams, scored with length_penalty; refused with
    stream, as vLLM does (the beams are known only at the end)."""
    if not request.use_beam_search:
        return None
    if request.stream:
        raise InvalidArgument("stream", "streaming is not supported with use_beam_search; "
                              "set stream to false")
    if request.n > MAX_BEAM_WIDTH:
        raise InvalidArgument("n", f"is the beam width with use_beam_search: at most "
                              f"{MAX_BEAM_WIDTH}")
    return BeamSearch(request.n, request.length_penalty)


def _structured_outputs(request: P.SamplingFields) -> StructuredOutputsParams | None:
    """From vLLM's `structured_outputs`, or OpenAI's `response_format`."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        constraint = request.structured_outputs
        return None if constraint is None else StructuredOutputsParams(
            json=constraint.json_schema, regex=constraint.regex, choice=constraint.choice,
            grammar=constraint.grammar, json_object=constraint.json_object,
            disable_any_whitespace=constraint.disable_any_whitespace)
    if request.structured_outputs is not None:
        raise InvalidArgument("response_format", "set response_format or structured_outputs, "
                              "not both")
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise InvalidArgument("response_format.json_schema",
                              "is required when type is json_schema")
    schema = response_format.json_schema.json_schema
    return StructuredOutputsParams(json=schema) if schema is not None \
        else StructuredOutputsParams(json_object=True)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise InvalidArgument("logit_bias", "keys must be token ids, e.g. {\"1234\": -100}") \
            from None


def completion_prompts(prompt: str | list) -> list[PromptInput]:
    """The prompts of a completions request (a list of texts or of token-id lists
    is a batch; a list of ints is one tokenized prompt)."""
    if isinstance(prompt, str):
        return [PromptInput(prompt=prompt)]
    if not prompt:
        raise InvalidArgument("prompt", "is empty")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(token_ids=list(prompt))]
    return [PromptInput(prompt=p) if isinstance(p, str) else PromptInput(token_ids=list(p))
            for p in prompt]


def chat_messages(messages: list[P.ChatMessage]) -> list[ChatMessage]:
    """Text parts of a message are joined with newlines, as vLLM does."""
    return [ChatMessage(m.role, m.content if isinstance(m.content, str)
                        else "\n".join(part.text for part in m.content)) for m in messages]


def usage(num_prompt_tokens: int, choices: list[ChoiceOutput], num_cached: int) -> P.Usage:
    completion = sum(c.num_generated_tokens for c in choices)
    return P.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                   total_tokens=num_prompt_tokens + completion,
                   prompt_tokens_details={"cached_tokens": num_cached})


def completion_logprobs(logprobs: list[Logprobs], text_offset: int) -> P.CompletionLogprobs:
    """The legacy completions format; offsets count from text_offset."""
    out = P.CompletionLogprobs()
    for lp in logprobs:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(dict(zip(lp.top_tokens, lp.top_logprobs)))
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


def chat_logprobs(logprobs: list[Logprobs]) -> P.ChatLogprobs:
    return P.ChatLogprobs(content=[P.TokenLogprob(
        token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
        top_logprobs=[P.TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                      for t, v in zip(lp.top_tokens, lp.top_logprobs)]) for lp in logprobs])


def finish_reason(choice: ChoiceOutput) -> str | None:
    return None if choice.finish_reason is None else str(choice.finish_reason)
