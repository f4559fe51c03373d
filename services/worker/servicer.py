"""WorkerServicer: the Worker over gRPC (convert, call, convert back)."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from services.common import convert
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.worker.metrics import WorkerMetrics
from services.worker.step_order import StepOrder
from services.worker.worker import Worker


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker, run: Callable[..., Awaitable] = asyncio.to_thread,
                 metrics: WorkerMetrics | None = None,
                 on_ready: Callable[[], Awaitable[None]] | None = None):
        """on_ready is awaited once the model and its KV cache are loaded."""
        self.worker = worker
        self.on_ready = on_ready
        # How model work runs off the event loop (so health checks answer during a
        # step): a thread by default, the main thread in the worker process.
        self.run = run
        self.execute_model = metrics.execute_model if metrics else worker.execute_model
        self.step_order = StepOrder(run)

    async def LoadModel(self, request, context):
        loaded = await self.run(self.worker.load_model,
                                convert.engine_config_from_proto(request.config))
        return convert.loaded_model_to_proto(loaded)

    async def DetermineNumKvBlocks(self, request, context):
        # On CUDA this runs a profiling forward pass: model work like the rest.
        return worker_pb2.DetermineNumKvBlocksResponse(
            num_blocks=await self.run(self.worker.determine_num_kv_blocks))

    async def InitKvCache(self, request, context):
        await self.run(self.worker.init_kv_cache, request.num_blocks)
        await self.step_order.reset()
        if self.on_ready is not None:
            await self.on_ready()
        return worker_pb2.InitKvCacheResponse()

    async def AddLora(self, request, context):
        await self.run(self.worker.add_lora, request.lora_id, request.lora_path)
        return worker_pb2.AddLoraResponse()

    async def RemoveLora(self, request, context):
        await self.run(self.worker.remove_lora, request.lora_id)
        return worker_pb2.RemoveLoraResponse()

    async def ExecuteModelStream(self, request_iterator, context):
        # Each step is handed over as it arrives, while the one before it may
        # still run; outputs go back in the order the steps came. A step's
        # LLMServeError ends the call with its status (ErrorMappingInterceptor).
        steps: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
        reader = asyncio.ensure_future(self._take_steps(request_iterator, steps))
        try:
            while (step := await steps.get()) is not None:
                yield convert.model_runner_output_to_proto(await step)
            await reader  # the error that ended the reading, if one did
        finally:  # after an early end (a step failed, the call was cancelled) too
            reader.cancel()
            while not steps.empty():
                if (step := steps.get_nowait()) is not None:
                    step.cancel()  # not run, if it has not started

    async def _take_steps(self, request_iterator, steps: asyncio.Queue) -> None:
        try:
            async for request in request_iterator:
                steps.put_nowait(self.step_order.submit(
                    request.step_id, self.execute_model,
                    convert.scheduler_output_from_proto(request)))
        finally:
            steps.put_nowait(None)
