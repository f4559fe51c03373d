"""InferenceServicer: the public llmserve.v1.Inference API (convert, call, convert back)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

from services.common import convert, tracing
from services.common.errors import AlreadyExists, LLMServeError
from services.common.pb import inference_pb2, inference_pb2_grpc
from services.common.request_types import EngineCoreOutput, EngineCoreRequest, Logprobs
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient
from services.frontend.output_processor import ChoiceState, CompletionOutput
from services.frontend.processor import ChatMessage, Processor

logger = logging.getLogger(__name__)
_tracer = tracing.tracer(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, processor: Processor, engine: EngineClient, model_name: str):
        self.processor = processor
        self.engine = engine
        self.model_name = model_name
        self.live_request_ids: set[str] = set()

    async def Generate(self, request, context):
        request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        if request_id in self.live_request_ids:
            raise AlreadyExists(f"request_id {request_id!r} is still running; use another id")
        params = convert.sampling_params_from_proto(request.sampling_params)
        parent = tracing.context_from_metadata(context.invocation_metadata())
        with _tracer.start_as_current_span("frontend.request", context=parent, attributes={
                "gen_ai.request.id": request_id, "gen_ai.request.n": params.n,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.response.model": self.model_name}) as span:
            prompt_ids = self.processor.tokenize(**_input_of(request))
            engine_requests = self.processor.make_requests(
                request_id, prompt_ids, params, tracing.current_trace_headers(), request.priority)
            choices = [ChoiceState(i, r.request_id, params, IncrementalDetokenizer(
                self.processor.tokenizer, params.skip_special_tokens))
                for i, r in enumerate(engine_requests)]
            self.live_request_ids.add(request_id)
            pending_prompt_logprobs: list[Logprobs] = []
            outcome = "cancelled"
            try:
                async for index, output in self._merged(engine_requests):
                    choice = choices[index]
                    if index == 0:
                        pending_prompt_logprobs += output.prompt_logprobs
                    completion = choice.update(output)
                    if choice.stopped_by_string:
                        await self.engine.abort([choice.engine_request_id])
                    if completion is None:
                        continue
                    response = self._response(request_id, completion, choice, len(prompt_ids),
                                              pending_prompt_logprobs if index == 0 else [])
                    if index == 0:
                        pending_prompt_logprobs = []
                    yield response
                outcome = ",".join(str(c.finish_reason) for c in choices)
            except LLMServeError as e:
                outcome = f"failed ({e.code.name})"
                raise
            finally:
                self.live_request_ids.discard(request_id)
                self._record(span, request_id, prompt_ids, choices, outcome)

    async def _merged(self, requests: list[EngineCoreRequest]
                      ) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        """The engine streams of all choices, interleaved as outputs arrive.
        Leaving early cancels every stream, which aborts its engine request."""
        if len(requests) == 1:
            async for output in self.engine.generate(requests[0]):
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: EngineCoreRequest) -> None:
            try:
                async for output in self.engine.generate(request):
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except Exception as e:  # handed to the consumer
                queue.put_nowait((index, e))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _response(self, request_id: str, completion: CompletionOutput, choice: ChoiceState,
                  num_prompt_tokens: int,
                  prompt_logprobs: list[Logprobs]) -> inference_pb2.GenerateResponse:
        response = inference_pb2.GenerateResponse(
            request_id=request_id, index=completion.index, text=completion.text,
            token_ids=completion.token_ids,
            logprobs=[self._logprobs_to_proto(lp) for lp in completion.logprobs or []],
            prompt_logprobs=[self._logprobs_to_proto(lp) for lp in prompt_logprobs])
        if completion.finished:
            response.finish_reason = int(completion.finish_reason)
            if isinstance(completion.stop_reason, str):
                response.stop_string = completion.stop_reason
            elif completion.stop_reason is not None:
                response.stop_token_id = completion.stop_reason
            response.usage.CopyFrom(inference_pb2.Usage(
                prompt_tokens=num_prompt_tokens, completion_tokens=len(choice.token_ids),
                cached_prompt_tokens=choice.num_cached_tokens))
            first = choice.first_token_time or choice.finish_time
            response.timings.CopyFrom(inference_pb2.Timings(
                time_to_first_token_s=first - choice.arrival_time,
                total_s=choice.finish_time - choice.arrival_time))
        return response

    def _logprobs_to_proto(self, lp: Logprobs):
        pb = convert.logprobs_to_proto(lp)
        texts = self.processor.tokenizer.batch_decode([[lp.token_id]] + [[t] for t in lp.top_token_ids])
        pb.token, pb.top_tokens[:] = texts[0], texts[1:]
        return pb

    def _record(self, span, request_id: str, prompt_ids: list[int], choices: list[ChoiceState],
                outcome: str) -> None:
        """The request's span attributes and its one log line."""
        now = time.monotonic()
        start = choices[0].arrival_time
        first = min((c.first_token_time for c in choices if c.first_token_time), default=now)
        generated = sum(len(c.token_ids) for c in choices)
        span.set_attributes({
            "gen_ai.usage.prompt_tokens": len(prompt_ids),
            "gen_ai.usage.completion_tokens": generated,
            "gen_ai.latency.e2e": now - start, "gen_ai.latency.time_to_first_token": first - start})
        logger.info("request %s %s: %d prompt + %d generated tokens, ttft %.3f s, e2e %.3f s",
                    request_id, outcome, len(prompt_ids), generated, first - start, now - start)

    async def Tokenize(self, request, context):
        ids = self.processor.tokenize(**_input_of(request))
        return inference_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.processor.tokenizer.batch_decode([[t] for t in ids]))

    async def Detokenize(self, request, context):
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return inference_pb2.DetokenizeResponse(
            text=self.processor.detokenize(list(request.token_ids), skip))

    async def GetModelInfo(self, request, context):
        info = await self.engine.get_info()
        return inference_pb2.ModelInfo(
            model=self.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=self.processor.eos_token_ids, dtype=info.dtype,
            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks)


def _input_of(request) -> dict:
    """The request's oneof `input` as keyword arguments for Processor.tokenize."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return {"prompt": request.prompt}
    if kind == "token_ids":
        return {"token_ids": list(request.token_ids.ids)}
    if kind == "chat":
        chat = request.chat
        return {"chat": [ChatMessage(m.role, m.content) for m in chat.messages],
                "add_generation_prompt": (chat.add_generation_prompt
                                          if chat.HasField("add_generation_prompt") else True)}
    return {}
