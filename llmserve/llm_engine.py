"""LLMEngine: the whole pipeline in this process, no gRPC, stepped by the caller
(vLLM's LLMEngine: add_request / step / abort_request)."""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from services.common.config import EngineConfig
from services.common.errors import AlreadyExists
from services.common.lora import LoRARequest
from services.common.model_store import resolve_model
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import InprocExecutor
from services.frontend.output_processor import OutputProcessor
from services.frontend.processor import Processor
from services.worker.worker import Worker
from llmserve.engine_args import EngineArgs
from llmserve.outputs import RequestOutput, to_request_output
from llmserve.prompts import PromptType, input_kwargs, prompt_text


def make_inproc_engine_core(config: EngineConfig) -> EngineCore:
    """An EngineCore with its worker in this process."""
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, model=resolve_model(config.model.model)))
    return EngineCore(config, InprocExecutor([Worker()]))


class LLMEngine:
    """Requests in, RequestOutputs out, one engine step per step()."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def __init__(self, config: EngineConfig):
        self.engine_core = make_inproc_engine_core(config)
        self.tokenizer, eos_token_ids = load_tokenizer(self.engine_core.info.model_path)
        self.processor = Processor(self.tokenizer, self.engine_core.info, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queues a request. Raises InvalidArgument naming a bad field, and adds
        nothing then: with n > 1, either every choice is queued or none."""
        if request_id in self.output_processor.requests:
            raise AlreadyExists(f"request_id {request_id!r} is still running")
        params = params or SamplingParams()
        prompt_ids = self.processor.tokenize(**input_kwargs(prompt))
        engine_requests = self.processor.make_requests(request_id, prompt_ids, params, {},
                                                       priority, lora_request)
        added: list[str] = []
        try:
            for engine_request in engine_requests:
                self.engine_core.add_request(engine_request)
                added.append(engine_request.request_id)
        except Exception:
            self.engine_core.abort_requests(added)
            raise
        # arrival_time is wall-clock time, as vLLM takes it; timings are monotonic.
        arrival = None if arrival_time is None else time.monotonic() - (time.time() - arrival_time)
        self.output_processor.add_request(request_id, prompt_text(prompt), prompt_ids, params,
                                          added, arrival)

    def step(self) -> list[RequestOutput]:
        """One engine step; what it changed, per request (see SamplingParams.output_kind)."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        if processed.engine_ids_to_abort:
            self.engine_core.abort_requests(processed.engine_ids_to_abort)
        return [to_request_output(o) for o in processed.outputs]

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.engine_core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()
