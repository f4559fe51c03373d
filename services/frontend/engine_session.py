"""EngineSession: the frontend's end of an engine core's Session stream.

Every request this frontend sends to one engine core goes over one stream, and
the outputs of a step come back as one message, which the session hands out to
each request's queue. When the stream breaks (the engine core went away), every
request on it ends with the stream's error; the next request opens a new one.
"""
from __future__ import annotations

import asyncio
import copy
import logging

import grpc

from services.common import convert
from services.common.errors import (LLMServeError, Unavailable, from_rpc_error,
                                    request_id_in_use)
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.request_types import EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineSession:
    def __init__(self, stub: engine_core_pb2_grpc.EngineCoreStub):
        self._sends: asyncio.Queue[engine_core_pb2.SessionRequest | None] = asyncio.Queue()
        # Request id -> its queue of EngineCoreOutput, or the error that ends it.
        self._queues: dict[str, asyncio.Queue] = {}
        self.closed = False
        self._call = stub.Session(self._requests())
        self._reader = asyncio.create_task(self._read())

    def add(self, request: EngineCoreRequest) -> asyncio.Queue:
        """Sends the request; returns the queue its outputs arrive in."""
        if request.request_id in self._queues:
            raise request_id_in_use(request.request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._sends.put_nowait(engine_core_pb2.SessionRequest(
            add=convert.engine_core_request_to_proto(request)))
        return queue

    def forget(self, request_id: str, abort: bool) -> None:
        """Stops handing out the request's outputs (and aborts it, if asked)."""
        self._queues.pop(request_id, None)
        if abort and not self.closed:
            self._sends.put_nowait(engine_core_pb2.SessionRequest(
                abort=engine_core_pb2.AbortRequest(request_ids=[request_id])))

    async def close(self) -> None:
        self.closed = True
        self._sends.put_nowait(None)
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _requests(self):
        while (message := await self._sends.get()) is not None:
            yield message

    async def _read(self) -> None:
        error: LLMServeError = Unavailable("the engine core ended the session")
        try:
            async for message in self._call:
                for output in message.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(_item(output))
        except grpc.aio.AioRpcError as e:
            error = from_rpc_error(e)
        except asyncio.CancelledError:
            error = Unavailable("the frontend closed its engine session")
        finally:
            closing, self.closed = self.closed, True
            for queue in self._queues.values():  # each its own exception: each is raised
                queue.put_nowait(copy.copy(error))
            self._queues.clear()
        if not closing:
            logger.warning("engine session ended: %s", error)


def _item(output: engine_core_pb2.EngineCoreOutput):
    if output.HasField("error"):
        return convert.request_error_from_proto(output.error)
    return convert.engine_core_output_from_proto(output)
