"""LLM: the offline API in this process (vLLM's `LLM(model)`): generate and chat,
or, with runner="pooling", embed, encode and score."""
from __future__ import annotations

import dataclasses
import itertools

from tqdm import tqdm

from services.common.beam_search import BeamSearchParams
from services.common.config import DEFAULT_MODEL
from services.common.lora import LoRARequest
from services.common.sampling_params import OutputKind, SamplingParams
from llmserve.beam_search import BeamSearchOutput, to_beam_search_output
from llmserve.engine_args import EngineArgs
from llmserve.llm_engine import LLMEngine
from llmserve.outputs import RequestOutput
from llmserve.pooling_outputs import (EmbeddingRequestOutput, PoolingRequestOutput,
                                      ScoringRequestOutput, cosine_score)
from services.common.pooling_params import PoolingParams, pair_for_scoring
from llmserve.prompts import PromptType, is_single_prompt

Conversation = list[dict[str, str]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        """LLM(model, dtype=..., max_model_len=..., kv_cache_gib=..., ...): the
        keyword arguments are EngineArgs' fields, vLLM's names among them; a vLLM
        argument llmserve does not have is refused by name (ValueError)."""
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order.
        sampling_params and lora_request: one for all prompts, or a list with one
        per prompt (LoRA needs LLM(..., enable_lora=True))."""
        self._check_runner("generate", "LLM.generate")
        if is_single_prompt(prompts):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The best params.beam_width sequences of each prompt, best first, in the
        prompts' order. The engine runs the beams of every prompt together, each
        beam group as one unit, sharing its KV blocks (see the README)."""
        self._check_runner("generate", "LLM.beam_search")
        if is_single_prompt(prompts):
            prompts = [prompts]
        sampling, search = params.to_engine()
        outputs = self._run(list(prompts), sampling, use_tqdm, lora_request, search)
        tokenizer = self.get_tokenizer()
        return [to_beam_search_output(o, params, tokenizer) for o in outputs]

    def embed(self, prompts: PromptType | list[PromptType],
              pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True,
              lora_request: LoRARequest | list[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (needs LLM(model, runner="pooling")), in the
        prompts' order; `outputs.embedding` is a list of floats."""
        return [EmbeddingRequestOutput.from_base(o)
                for o in self.encode(prompts, pooling_params, use_tqdm, lora_request)]

    def encode(self, prompts: PromptType | list[PromptType],
               pooling_params: PoolingParams | list[PoolingParams] | None = None,
               use_tqdm: bool = True,
               lora_request: LoRARequest | list[LoRARequest | None] | None = None,
               pooling_task: str = "embed") -> list[PoolingRequestOutput]:
        """One pooled vector per prompt, as a tensor in `outputs.data`."""
        self._check_runner("pooling", "LLM.encode and LLM.embed")
        if pooling_task != "embed":
            raise ValueError(f"pooling_task {pooling_task!r}: llmserve pools for 'embed' only")
        if is_single_prompt(prompts):
            prompts = [prompts]
        return self._run(list(prompts), pooling_params or PoolingParams(), use_tqdm,
                         lora_request)

    def score(self, data_1: PromptType | list[PromptType], data_2: PromptType | list[PromptType],
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None
              ) -> list[ScoringRequestOutput]:
        """The cosine similarity of embeddings: one text against each of many, or
        two lists pairwise (as vLLM's score for embedding models)."""
        second = [data_2] if is_single_prompt(data_2) else list(data_2)
        try:
            first = pair_for_scoring([data_1] if is_single_prompt(data_1) else list(data_1),
                                     second)
        except ValueError as e:
            raise ValueError(f"score: {e}") from None
        pooled = self.encode(first + second, pooling_params, use_tqdm)
        return [cosine_score(str(i), a, b)
                for i, (a, b) in enumerate(zip(pooled[:len(first)], pooled[len(first):]))]

    def _check_runner(self, runner: str, what: str) -> None:
        """vLLM's rule: generation on a generate runner, pooling on a pooling one."""
        if self.llm_engine.engine_core.config.model.runner != runner:
            raise ValueError(f"{what} needs LLM(model, runner={runner!r})")

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation or a list of them, each rendered with the model's chat
        template; one RequestOutput per conversation."""
        self._check_runner("generate", "LLM.chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run(list(conversations), sampling_params, use_tqdm)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool,
             lora_request=None, beam_search=None) -> list[RequestOutput]:
        # Sampling params, or pooling params (encode and embed).
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "params")
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        ids = self._add_all(prompts, params, loras, beam_search)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

    def _add_all(self, prompts: list, params: list[SamplingParams | PoolingParams],
                 loras: list[LoRARequest | None], beam_search=None) -> list[str]:
        """Queues every prompt, or none if one is refused."""
        ids: list[str] = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                request_id = str(next(self._request_counter))
                if isinstance(sp, SamplingParams):  # only final outputs are read
                    sp = dataclasses.replace(sp, output_kind=OutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, sp, lora_request=lora,
                                            beam_search=beam_search)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return ids


def _per_prompt(value, num_prompts: int, what: str) -> list:
    """One for all prompts, or a list with one per prompt."""
    values = value if isinstance(value, list) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"{num_prompts} prompts but {len(values)} {what}")
    return values
