"""Processor: turns user input (prompt, token ids or chat) into an engine-core request."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jinja2 import TemplateError

from services.common.beam_search import BeamSearch
from services.common.errors import InvalidArgument
from services.common.lora import LoRARequest
from services.common.pooling_params import PoolingParams, truncate_prompt
from services.common.request_types import EngineCoreRequest, EngineInfo
from services.common.sampling_params import SamplingParams

# Text longer than this many characters per token of max_model_len is refused
# before tokenizing it (tokenizing megabytes would hold a thread for seconds,
# only to refuse the prompt as too long afterwards).
MAX_PROMPT_CHARS_PER_TOKEN = 32


@dataclass
class ChatMessage:
    role: str
    content: str


class Processor:
    def __init__(self, tokenizer, engine_info: EngineInfo, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.engine_info = engine_info
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: str | None = None, token_ids: list[int] | None = None,
                 chat: list[ChatMessage] | None = None,
                 add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
        """Token ids of exactly one kind of input."""
        given = [name for name, v in (("prompt", prompt), ("token_ids", token_ids), ("chat", chat))
                 if v is not None]
        if len(given) != 1:
            raise InvalidArgument("input", "give exactly one of prompt, token_ids or chat"
                                  + (f" (got {', '.join(given)})" if given else ""))
        self._check_text_length(prompt or "".join(m.content for m in chat or ()),
                                "prompt" if prompt is not None else "chat.messages")
        if prompt is not None:
            if not prompt:
                raise InvalidArgument("prompt", "is empty")
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if token_ids is not None:
            self._check_token_ids(token_ids)
            return list(token_ids)
        return self._render_chat(chat, add_generation_prompt)

    def make_requests(self, request_id: str, prompt_token_ids: list[int],
                      sampling_params: SamplingParams, trace_headers: dict[str, str],
                      priority: int = 0, lora_request: LoRARequest | None = None,
                      beam_search: BeamSearch | None = None) -> list[EngineCoreRequest]:
        """One engine request per choice. With n > 1 they share the prompt, so all
        but the first find its KV in the prefix cache; seeded choices get seed + i,
        so the n completions differ yet are reproducible. Beam search is one engine
        request, whatever its width."""
        sampling_params.validate(self.engine_info.vocab_size)
        if beam_search is not None:
            beam_search.validate(sampling_params)
        max_len = self.engine_info.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise InvalidArgument("input", f"the prompt has {len(prompt_token_ids)} tokens; the "
                                  f"model's max_model_len is {max_len} (prompt + output)")
        sampling_params = self._resolve(sampling_params, len(prompt_token_ids))
        if beam_search is not None:
            return [EngineCoreRequest(
                request_id, prompt_token_ids, sampling_params, eos_token_ids=self.eos_token_ids,
                trace_headers=trace_headers, priority=priority,
                queue_slots=beam_search.beam_width, lora_request=lora_request,
                beam_search=beam_search)]
        n = sampling_params.n
        return [EngineCoreRequest(
            request_id=request_id if n == 1 else f"{request_id}-{i}",
            prompt_token_ids=prompt_token_ids,
            sampling_params=(sampling_params if sampling_params.seed is None else
                             dataclasses.replace(sampling_params,
                                                 seed=(sampling_params.seed + i) % 2**64)),
            eos_token_ids=self.eos_token_ids, trace_headers=trace_headers, priority=priority,
            queue_slots=n - i, lora_request=lora_request)
            for i in range(n)]

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             pooling_params: PoolingParams, trace_headers: dict[str, str],
                             priority: int = 0, lora_request: LoRARequest | None = None
                             ) -> EngineCoreRequest:
        """A prefill-only request, its prompt cut to truncate_prompt_tokens; the
        engine core resolves the pooler and checks the params (its sampling
        params are unused)."""
        prompt_token_ids = truncate_prompt(prompt_token_ids, pooling_params,
                                           self.engine_info.max_model_len)
        return EngineCoreRequest(request_id, prompt_token_ids, SamplingParams(max_tokens=1),
                                 trace_headers=trace_headers, priority=priority,
                                 lora_request=lora_request, pooling_params=pooling_params)

    def _resolve(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """What the engine needs spelled out: max_tokens=None as the room max_model_len
        leaves, and bad_words as token-id sequences."""
        changes = {}
        if params.max_tokens is None:
            changes["max_tokens"] = self.engine_info.max_model_len - num_prompt_tokens
        if params.bad_words:
            changes["bad_words_token_ids"] = (params.bad_words_token_ids
                                              + bad_words_token_ids(self.tokenizer, params.bad_words))
        return dataclasses.replace(params, **changes) if changes else params

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self._check_token_ids(token_ids, allow_empty=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_text_length(self, text: str, field_name: str) -> None:
        limit = MAX_PROMPT_CHARS_PER_TOKEN * self.engine_info.max_model_len
        if len(text) > limit:
            raise InvalidArgument(field_name, f"has {len(text)} characters; at most {limit} "
                                  f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of max_model_len)")

    def _check_token_ids(self, token_ids: list[int], allow_empty: bool = False) -> None:
        if not token_ids and not allow_empty:
            raise InvalidArgument("token_ids", "is empty")
        vocab = self.engine_info.vocab_size
        # Offline callers may pass anything: a non-integer is refused, not a TypeError.
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument("token_ids", f"{bad!r} is not a token id in [0, {vocab})")

    def _render_chat(self, chat: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        if not chat:
            raise InvalidArgument("chat.messages", "is empty")
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("chat", "this model has no chat template; send a prompt")
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in chat],
                add_generation_prompt=add_generation_prompt, tokenize=False)
        except TemplateError as e:  # the template refuses these messages (roles, order)
            raise InvalidArgument("chat.messages", f"the chat template refused them: {e}") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word alone, and with a leading space
    when that gives a different first token and as many tokens (so the word is
    banned both at the start of the text and after a space)."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
