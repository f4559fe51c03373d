"""OpenAI request bodies -> the frontend's inputs and SamplingParams, and its
outputs -> OpenAI response pieces. The only place HTTP bodies are converted."""
from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.request_types import Logprobs
from services.common.sampling_params import OutputKind, SamplingParams
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
        n=request.n, max_tokens=max_tokens, seed=request.seed, stop=request.stop,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=_logit_bias(request.logit_bias), logprobs=logprobs,
        min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        stop_token_ids=request.stop_token_ids, allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        output_kind=OutputKind.DELTA if request.stream else OutputKind.FINAL_ONLY,
        **{k: v for k, v in optional.items() if v is not None})


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
