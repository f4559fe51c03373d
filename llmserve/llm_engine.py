"""LLMEngine: the whole pipeline in this process, no gRPC, stepped by the caller
(vLLM's LLMEngine: add_request / step / abort_request)."""
from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Iterable

import torch

from services.common.beam_search import BeamSearch
from services.common.config import EngineConfig
from services.common.errors import AlreadyExists
from services.common.lora import LoRARequest
from services.common.model_store import with_resolved_models
from services.common.pooling_params import PoolingParams
from services.common.request_types import EngineCoreOutput
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import GrpcExecutor, InprocExecutor, default_init_method
from services.frontend.output_processor import OutputProcessor
from services.frontend.processor import Processor
from services.worker.worker import Worker
from llmserve.engine_args import EngineArgs
from llmserve.outputs import RequestOutput, to_request_output
from llmserve.pooling_outputs import PoolingOutput, PoolingRequestOutput
from llmserve.prompts import PromptType, input_kwargs, prompt_text


def make_inproc_engine_core(config: EngineConfig) -> EngineCore:
    """An EngineCore with its worker in this process."""
    return EngineCore(_resolved(config), InprocExecutor([Worker()]))


def make_engine_core(config: EngineConfig) -> EngineCore:
    """An EngineCore in this process: with its worker here too, or, with tensor or
    pipeline parallelism, over one worker process per rank on this machine (each on
    its own cores), stopped when the engine core is collected or Python exits."""
    parallel = config.parallel
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1:
        return make_inproc_engine_core(config)
    from llmserve.launcher import LocalStack

    return engine_core_over_workers(LocalStack(_resolved(config)))


def engine_core_over_workers(stack) -> EngineCore:
    """An EngineCore in this process over the LocalStack's workers, started here and
    stopped when the engine core is collected or Python exits."""
    config, parallel = stack.config, stack.config.parallel
    try:
        addresses = stack.start_workers()
        if not parallel.distributed_init_method:
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                parallel, distributed_init_method=default_init_method(addresses[0])))
        executor = GrpcExecutor(addresses)
        executor.wait_ready(120.0)
        core = EngineCore(config, executor)
    except BaseException:
        stack.stop(grace_s=5.0)
        raise
    weakref.finalize(core, _stop_workers, executor, stack)
    return core


def _stop_workers(executor: GrpcExecutor, stack) -> None:
    """Ends the step streams, then stops the workers. A worker stopped with its
    stream still open waits out its grace period and then cuts the call, which
    gRPC logs at ERROR with a traceback."""
    executor.shutdown()
    stack.stop(grace_s=5.0)


def _resolved(config: EngineConfig) -> EngineConfig:
    """The config with its models as local paths (the default model's package)."""
    return with_resolved_models(config)


class LLMEngine:
    """Requests in, RequestOutputs out, one engine step per step()."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def __init__(self, config: EngineConfig, engine_core: EngineCore | None = None):
        """engine_core: one made by the caller (the bench's, over workers it
        watches); by default make_engine_core's."""
        self.engine_core = engine_core or make_engine_core(config)
        self.tokenizer, eos_token_ids = load_tokenizer(self.engine_core.info.model_path)
        self.processor = Processor(self.tokenizer, self.engine_core.info, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Pooling requests in flight -> their prompt ids (no detokenizing, one output).
        self._pooling: dict[str, list[int]] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None,
                    beam_search: BeamSearch | None = None) -> None:
        """Queues a request: generation with SamplingParams (beam search with a
        BeamSearch too), pooling with PoolingParams. Raises InvalidArgument naming
        a bad field, and adds nothing then: with n > 1, either every choice is
        queued or none."""
        if request_id in self.output_processor.requests or request_id in self._pooling:
            raise AlreadyExists(f"request_id {request_id!r} is still running")
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, priority, lora_request)
        params = params or SamplingParams()
        prompt_ids = self.processor.tokenize(**input_kwargs(prompt))
        engine_requests = self.processor.make_requests(request_id, prompt_ids, params, {},
                                                       priority, lora_request, beam_search)
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
                                          added, arrival,
                                          beam_search.beam_width if beam_search else 0)

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             priority: int, lora_request: LoRARequest | None) -> None:
        """A prefill-only request (Processor.make_pooling_request)."""
        request = self.processor.make_pooling_request(
            request_id, self.processor.tokenize(**input_kwargs(prompt)), params, {}, priority,
            lora_request)
        self.engine_core.add_request(request)
        self._pooling[request_id] = request.prompt_token_ids

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step; what it changed, per request (see SamplingParams.output_kind):
        RequestOutputs, and a PoolingRequestOutput for each pooling request it finished."""
        outputs = self.engine_core.step()
        pooled = [self._pooling_output(o) for o in outputs if o.request_id in self._pooling]
        processed = self.output_processor.process_outputs(
            [o for o in outputs if o.request_id not in self._pooling])
        if processed.engine_ids_to_abort:
            self.engine_core.abort_requests(processed.engine_ids_to_abort)
        return [to_request_output(o) for o in processed.outputs] + pooled

    def _pooling_output(self, output: EngineCoreOutput) -> PoolingRequestOutput:
        prompt_ids = self._pooling.pop(output.request_id)
        data = torch.tensor(output.pooled if output.pooled is not None else [],
                            dtype=torch.float32)
        return PoolingRequestOutput(output.request_id, PoolingOutput(data), prompt_ids,
                                    finished=True, num_cached_tokens=output.num_cached_tokens)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self._pooling.pop(request_id, None) is not None:
                self.engine_core.abort_requests([request_id])
                continue
            self.engine_core.abort_requests(self.output_processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pooling) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._pooling) + self.output_processor.get_num_unfinished_requests()
