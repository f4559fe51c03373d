"""EngineClient: how the frontend reaches an engine core (in this process, or over gRPC)."""
from __future__ import annotations

import abc
import asyncio
from typing import AsyncIterator

import grpc

from services.common import convert, tracing
from services.common.errors import FailedPrecondition, Unavailable, from_rpc_error
from services.common.lora import LoRARequest
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.request_types import (EngineCoreOutput, EngineCoreRequest, EngineInfo,
                                           EngineStats)
from services.common.tls import TlsConfig, aio_channel
from services.engine_core.engine_loop import EngineLoop, outputs_until_finished
from services.frontend.engine_session import EngineSession


class EngineClient(abc.ABC):
    @abc.abstractmethod
    def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Streams the request's outputs; closing the iterator early aborts it."""

    @abc.abstractmethod
    async def abort(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    async def get_stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def get_info(self) -> EngineInfo: ...

    async def add_lora(self, lora: LoRARequest) -> None:
        """Loads a LoRA adapter (on every engine core replica)."""
        raise FailedPrecondition(f"{type(self).__name__} cannot load LoRA adapters")

    async def remove_lora(self, name: str) -> None:
        raise FailedPrecondition(f"{type(self).__name__} cannot unload LoRA adapters")

    async def close(self) -> None:
        pass


class InprocEngineClient(EngineClient):
    """An engine core running in this process (no gRPC)."""

    def __init__(self, engine: EngineLoop):
        self.engine = engine

    def generate(self, request):
        return self.engine.generate(request)

    async def abort(self, request_ids):
        await self.engine.abort(request_ids)

    async def get_stats(self):
        return self.engine.stats()

    async def get_info(self):
        return self.engine.core.info

    async def add_lora(self, lora):
        await self.engine.add_lora(lora)

    async def remove_lora(self, name):
        await self.engine.remove_lora(name)

    async def close(self):
        await self.engine.shutdown()


class GrpcEngineClient(EngineClient):
    """A remote engine core."""

    def __init__(self, address: str, tls: TlsConfig = TlsConfig(), server_name: str = ""):
        self.address = address
        self.channel = aio_channel(address, tls, server_name)
        self.stub = engine_core_pb2_grpc.EngineCoreStub(self.channel)
        self._session: EngineSession | None = None  # opened by the first request

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"engine core at {self.address} did not answer within "
                              f"{timeout_s:.0f} s") from None

    async def generate(self, request):
        """Over this client's one session with the engine core (see engine_session)."""
        if self._session is None or self._session.closed:
            self._session = EngineSession(self.stub)
        session = self._session
        queue = session.add(request)
        finished = False
        try:
            async for output in outputs_until_finished(queue):
                finished = output.finished
                yield output
        finally:
            session.forget(request.request_id, abort=not finished)

    async def abort(self, request_ids):
        await self._unary(self.stub.Abort, engine_core_pb2.AbortRequest(request_ids=request_ids))

    async def get_stats(self):
        return convert.engine_stats_from_proto(
            await self._unary(self.stub.GetStats, engine_core_pb2.GetStatsRequest()))

    async def get_info(self):
        return convert.engine_info_from_proto(
            await self._unary(self.stub.GetEngineInfo, engine_core_pb2.GetEngineInfoRequest()))

    async def add_lora(self, lora):
        await self._unary(self.stub.AddLora, convert.lora_to_proto(lora))

    async def remove_lora(self, name):
        await self._unary(self.stub.RemoveLora, engine_core_pb2.RemoveLoraRequest(name=name))

    async def close(self):
        if self._session is not None:
            await self._session.close()
        await self.channel.close()

    @staticmethod
    async def _unary(method, request):
        try:
            return await method(request, metadata=tracing.trace_metadata(), timeout=30)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

