"""EngineCoreServicer: the EngineLoop over gRPC (convert, call, convert back)."""
from __future__ import annotations

import asyncio
import logging

from services.common import convert
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.engine_core.engine_loop import EngineLoop
from services.engine_core.session import EngineSession

logger = logging.getLogger(__name__)


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServicer):
    def __init__(self, engine: EngineLoop):
        self.engine = engine

    async def Session(self, request_iterator, context):
        # Read once: the finally below can run after the server has stopped (a drain
        # that timed out), when touching the call's context crashed the process.
        peer = context.peer()
        logger.info("session opened by %s", peer)
        session = EngineSession(self.engine)
        taking = asyncio.create_task(session.take(request_iterator))
        try:
            async for message in session.outputs():
                yield message
        except asyncio.CancelledError:
            pass  # the frontend left, or this server stops: the normal end of a session
        finally:
            taking.cancel()
            session.close()
            logger.info("session of %s closed", peer)

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
