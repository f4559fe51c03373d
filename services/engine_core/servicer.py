"""EngineCoreServicer: the EngineLoop over gRPC (convert, call, convert back)."""
from __future__ import annotations

from services.common import convert, tracing
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.request_types import EngineCoreOutput
from services.engine_core.engine_loop import EngineLoop
from services.engine_core.request_spans import record_phase_spans

_tracer = tracing.tracer(__name__)


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServicer):
    def __init__(self, engine: EngineLoop):
        self.engine = engine

    async def Generate(self, request, context):
        parent = tracing.context_from_metadata(context.invocation_metadata())
        with _tracer.start_as_current_span(
                "engine_core.request", context=parent,
                attributes={"gen_ai.request.id": request.request_id}) as span:
            engine_request = convert.engine_core_request_from_proto(request)
            # The steps that serve this request link to this span.
            engine_request.trace_headers = tracing.current_trace_headers()
            num_tokens = 0
            async for output in self.engine.generate(engine_request):
                num_tokens += len(output.new_token_ids)
                if output.finished:
                    _end_request_span(span, output, len(engine_request.prompt_token_ids),
                                      num_tokens)
                yield convert.engine_core_output_to_proto(output)

    async def Abort(self, request, context):
        await self.engine.abort(list(request.request_ids))
        return engine_core_pb2.AbortResponse()

    async def ResetPrefixCache(self, request, context):
        await self.engine.reset_prefix_cache()
        return engine_core_pb2.ResetPrefixCacheResponse()

    async def GetStats(self, request, context):
        return convert.engine_stats_to_proto(self.engine.stats())

    async def GetEngineInfo(self, request, context):
        return convert.engine_info_to_proto(self.engine.core.info)

    async def AddLora(self, request, context):
        await self.engine.add_lora(convert.lora_from_proto(request))
        return engine_core_pb2.AddLoraResponse()

    async def RemoveLora(self, request, context):
        await self.engine.remove_lora(request.name)
        return engine_core_pb2.RemoveLoraResponse()


def _end_request_span(span, last: EngineCoreOutput, num_prompt_tokens: int,
                      num_output_tokens: int) -> None:
    """The request's usage and outcome, and its phases as child spans."""
    if not tracing.is_exporting():
        return
    span.set_attributes({"gen_ai.usage.input_tokens": num_prompt_tokens,
                         "gen_ai.usage.output_tokens": num_output_tokens,
                         "gen_ai.response.finish_reasons": [str(last.finish_reason)]})
    record_phase_spans(_tracer, last.events)
