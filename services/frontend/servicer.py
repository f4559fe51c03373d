"""InferenceServicer: the public llmserve.v1.Inference API (convert, call, convert back)."""
from __future__ import annotations

import logging
import time
import uuid

from services.common import convert, tracing
from services.common.pb import inference_pb2, inference_pb2_grpc
from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient
from services.frontend.processor import ChatMessage, Processor

logger = logging.getLogger(__name__)
_tracer = tracing.tracer(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, processor: Processor, engine: EngineClient, model_name: str):
        self.processor = processor
        self.engine = engine
        self.model_name = model_name

    async def Generate(self, request, context):
        parent = tracing.context_from_metadata(context.invocation_metadata())
        request_id = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        params = convert.sampling_params_from_proto(request.sampling_params)
        with _tracer.start_as_current_span("frontend.request", context=parent, attributes={
                "gen_ai.request.id": request_id, "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.response.model": self.model_name}) as span:
            prompt_ids = self.processor.tokenize(**_input_of(request))
            engine_request = self.processor.make_request(
                request_id, prompt_ids, params, tracing.current_trace_headers(), request.priority)
            detokenizer = IncrementalDetokenizer(self.processor.tokenizer)
            start, first_token_at, num_generated = time.monotonic(), None, 0
            finish_reason = "cancelled"
            try:
                async for output in self.engine.generate(engine_request):
                    num_generated += len(output.new_token_ids)
                    first_token_at = first_token_at or time.monotonic()
                    response = inference_pb2.GenerateResponse(
                        request_id=request_id, text=detokenizer.add_tokens(output.new_token_ids),
                        token_ids=output.new_token_ids)
                    if output.finished:
                        finish_reason = str(output.finish_reason)
                        response.finish_reason = int(output.finish_reason)
                        response.usage.CopyFrom(inference_pb2.Usage(
                            prompt_tokens=len(prompt_ids), completion_tokens=num_generated,
                            cached_prompt_tokens=output.num_cached_tokens))
                    yield response
            finally:
                e2e, ttft = time.monotonic() - start, (first_token_at or start) - start
                span.set_attributes({
                    "gen_ai.usage.prompt_tokens": len(prompt_ids),
                    "gen_ai.usage.completion_tokens": num_generated,
                    "gen_ai.latency.e2e": e2e, "gen_ai.latency.time_to_first_token": ttft})
                logger.info("request %s %s: %d prompt + %d generated tokens, ttft %.3f s, "
                            "e2e %.3f s", request_id, finish_reason, len(prompt_ids),
                            num_generated, ttft, e2e)

    async def Tokenize(self, request, context):
        ids = self.processor.tokenize(**_input_of(request))
        tokenizer = self.processor.tokenizer
        return inference_pb2.TokenizeResponse(
            token_ids=ids, tokens=[tokenizer.decode([t]) for t in ids])

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
