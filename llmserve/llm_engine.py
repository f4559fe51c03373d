"""LLMEngine: the whole pipeline in this process, no gRPC, stepped by the caller
(vLLM's LLMEngine.add_request / step / abort_request)."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from services.common.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig,
                                    SchedulerConfig)
from services.common.errors import AlreadyExists
from services.common.model_store import resolve_model
from services.common.request_types import EngineCoreOutput, Logprobs
from services.common.sampling_params import SamplingParams
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import InprocExecutor
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.output_processor import ChoiceState, RequestOutput
from services.frontend.processor import ChatMessage, Processor
from services.frontend.tokenizer import load_tokenizer
from services.worker.worker import Worker

# A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | list[int] | list[dict]


def make_engine_config(model: str = DEFAULT_MODEL, dtype: str = "auto",
                       max_model_len: int = 2048, kv_cache_gib: float = 1.0, seed: int = 0,
                       enable_prefix_caching: bool = True, max_num_seqs: int = 128,
                       max_num_batched_tokens: int = 2048,
                       scheduling_policy: str = "fcfs") -> EngineConfig:
    """An EngineConfig from the keyword arguments LLM and LLMEngine.create take."""
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),
        cache=CacheConfig(kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  policy=scheduling_policy))


def make_inproc_engine_core(config: EngineConfig) -> EngineCore:
    """An EngineCore with its worker in this process."""
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, model=resolve_model(config.model.model)))
    return EngineCore(config, InprocExecutor([Worker()]))


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    prompt_logprobs: list[Logprobs] = field(default_factory=list)

    def output(self, request_id: str) -> RequestOutput:
        return RequestOutput(
            request_id=request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[c.snapshot() for c in self.choices],
            prompt_logprobs=self.prompt_logprobs if self.choices[0].params.prompt_logprobs
            is not None else None, num_cached_tokens=self.choices[0].num_cached_tokens)


class LLMEngine:
    """Requests in, RequestOutputs out, one step at a time."""

    @classmethod
    def create(cls, **kwargs) -> "LLMEngine":
        """LLMEngine.create(model=..., scheduling_policy="priority", ...): see
        make_engine_config for the arguments."""
        return cls(make_engine_config(**kwargs))

    def __init__(self, config: EngineConfig):
        self.core = make_inproc_engine_core(config)
        tokenizer, eos_token_ids = load_tokenizer(self.core.info.model_path)
        self.tokenizer = tokenizer
        self.processor = Processor(tokenizer, self.core.info, eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._choice_of: dict[str, tuple[str, int]] = {}  # engine request id -> (request, index)

    def add_request(self, request_id: str | None, prompt: Prompt,
                    params: SamplingParams | None = None, priority: int = 0) -> str:
        """Queues a request; raises InvalidArgument naming a bad field."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise AlreadyExists(f"request_id {request_id!r} is still running")
        params = params or SamplingParams()
        prompt_ids = self.processor.tokenize(**_input_kwargs(prompt))
        engine_requests = self.processor.make_requests(request_id, prompt_ids, params, {}, priority)
        for r in engine_requests:
            self.core.add_request(r)
        choices = [ChoiceState(i, r.request_id, params, IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens)) for i, r in enumerate(engine_requests)]
        self._requests[request_id] = _Request(prompt if isinstance(prompt, str) else None,
                                              prompt_ids, choices)
        for i, r in enumerate(engine_requests):
            self._choice_of[r.request_id] = (request_id, i)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            request = self._requests.pop(request_id, None)
            if request is not None:
                engine_ids = [c.engine_request_id for c in request.choices]
                self.core.abort_requests(engine_ids)
                for engine_id in engine_ids:
                    self._choice_of.pop(engine_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One engine step; the state of every request it advanced."""
        touched: dict[str, _Request] = {}
        for output in self.core.step():
            request_id, index = self._choice_of.get(output.request_id, (None, 0))
            if request_id is None:
                continue
            request = self._requests[request_id]
            self._apply(request, index, output)
            touched[request_id] = request
        results = []
        for request_id, request in touched.items():
            results.append(request.output(request_id))
            if all(c.finished for c in request.choices):
                del self._requests[request_id]
                for c in request.choices:
                    self._choice_of.pop(c.engine_request_id, None)
        return results

    def _apply(self, request: _Request, index: int, output: EngineCoreOutput) -> None:
        choice = request.choices[index]
        if index == 0:
            request.prompt_logprobs += output.prompt_logprobs
        choice.update(output)
        if choice.stopped_by_string:
            self.core.abort_requests([choice.engine_request_id])


def _input_kwargs(prompt: Prompt) -> dict:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and isinstance(prompt[0], dict):
        return {"chat": [ChatMessage(m["role"], m["content"]) for m in prompt]}
    return {"token_ids": list(prompt)}
