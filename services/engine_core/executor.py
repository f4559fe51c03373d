"""Executors: how the engine core reaches its workers (in this process, or over gRPC)."""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import threading
from typing import Awaitable, Callable

import grpc

from services.common import convert
from services.common.config import EngineConfig
from services.common.errors import from_rpc_error
from services.common.futures import run_into_future
from services.common.ports import free_port
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.request_types import LoadedModel
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.common.tls import TlsConfig, aio_channel, sync_channel
from services.engine_core.step_streams import StepStreams, StreamEnded, lost_worker_first


# How long shutdown waits for the step in flight (a step takes milliseconds).
_SHUTDOWN_STEP_WAIT_S = 10.0


class PendingStep:
    """A step sent to the workers. result() returns the output that counts (rank
    0's without pipeline parallelism), waiting for it if need be, or raises the
    step's error; on the event loop its steps run on, wait() is awaited first."""

    def __init__(self, result: Callable[[], ModelRunnerOutput],
                 wait: Callable[[], Awaitable[None]] | None = None):
        self.result = result
        self._wait = wait

    async def wait(self) -> None:
        """Until the output is there (or the step failed); never raises."""
        if self._wait is not None:
            await self._wait()


class Executor(abc.ABC):
    """Runs each step on every worker and returns the result of the last pipeline
    stage's first rank (rank 0 without pipeline parallelism)."""

    # Whether a step can run on the workers while the engine core schedules the
    # next one (async scheduling); not when the workers run inside the call.
    overlaps_steps = False
    # Whether a step's output arrives on the event loop that sent it, to be
    # awaited there (PendingStep.wait); otherwise steps run inside the call.
    steps_on_event_loop = False

    @abc.abstractmethod
    def load_model(self, config: EngineConfig) -> LoadedModel: ...

    @abc.abstractmethod
    def add_lora(self, lora_id: int, lora_path: str) -> None:
        """Every worker reads the adapter; InvalidArgument when it cannot be applied."""

    @abc.abstractmethod
    def remove_lora(self, lora_id: int) -> None: ...

    @abc.abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """The number of KV blocks every worker can hold."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocates the KV cache; steps sent before it and not run yet are refused."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Sends the step and returns without waiting for it (async scheduling).
        Here: runs it first, for executors whose workers run inside the call."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        run_into_future(future, self.execute_model, scheduler_output)
        return PendingStep(future.result)

    def reconnect(self) -> None:
        """Waits until restarted workers answer again; raises if they cannot come
        back (in-process workers cannot die alone)."""
        raise NotImplementedError(f"{type(self).__name__} cannot recover its workers")

    def shutdown(self) -> None:
        pass


class InprocExecutor(Executor):
    """Calls Worker objects living in this process."""

    def __init__(self, workers):
        self.workers = workers

    def load_model(self, config):
        parallel = config.parallel
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1 \
                or len(self.workers) != 1:
            raise ValueError("in-process execution runs one worker; tensor and pipeline "
                             "parallelism need worker processes (llmserve serve "
                             "--tensor-parallel-size N --pipeline-parallel-size P)")
        return self.workers[0].load_model(config)

    def add_lora(self, lora_id, lora_path):
        for w in self.workers:
            w.add_lora(lora_id, lora_path)

    def remove_lora(self, lora_id):
        for w in self.workers:
            w.remove_lora(lora_id)

    def determine_num_kv_blocks(self):
        return min(w.determine_num_kv_blocks() for w in self.workers)

    def init_kv_cache(self, num_blocks):
        for w in self.workers:
            w.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output):
        outputs = [w.execute_model(scheduler_output) for w in self.workers]
        return outputs[0]


def default_init_method(rank0_address: str) -> str:
    """tcp://<rank 0's host>:<a port free here>: right when the workers run on this
    host (llmserve serve); elsewhere pass --distributed-init-method."""
    host = rank0_address.rsplit(":", 1)[0]
    return f"tcp://{host}:{free_port('')}"


class GrpcExecutor(Executor):
    """Talks to remote worker processes; each step goes to every worker, on a
    stream per worker (StepStreams) that stays open while it works."""

    overlaps_steps = True
    steps_on_event_loop = True

    def __init__(self, addresses: list[str], tls: TlsConfig = TlsConfig(),
                 rpc_timeout_s: float = 600.0):
        self.addresses, self.tls = addresses, tls
        # Unary calls (loading, adapters) block their caller, on a channel each.
        self.channels = [sync_channel(a, tls) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.rpc_timeout_s = rpc_timeout_s  # a call's deadline, and a step's output's
        # Steps go on grpc.aio streams, on the event loop running at the first
        # step (a served engine core's), or else on this thread's private one
        # (_private_loop), run here.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owns_loop = False
        self._step_channels: list[grpc.aio.Channel] = []
        self._steps: StepStreams | None = None
        # The rank whose step output counts: the last stage's first (ranks are
        # stage-major), set by load_model.
        self._output_rank = 0

    def wait_ready(self, timeout_s: float) -> None:
        for channel in self.channels:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)

    def reconnect(self, timeout_s: float = 5.0) -> None:
        steps = self._steps
        if steps is not None and steps.error is None:
            # A restarted worker's stream died with it.
            self._block_on(lambda: _coroutine(steps.cancel, StreamEnded()))
        self.wait_ready(timeout_s)
        if self._step_channels:  # the steps' channels too, or a step could fail fast
            self._block_on(lambda: self._step_channels_ready(timeout_s))

    async def _step_channels_ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(asyncio.gather(
            *(c.channel_ready() for c in self._step_channels)), timeout_s)

    def _call_all(self, method: str, request):
        return self._responses(self._start_all(method, request))

    def _start_all(self, method: str, request) -> list[grpc.Future]:
        return [getattr(stub, method).future(request, timeout=self.rpc_timeout_s)
                for stub in self.stubs]

    @staticmethod
    def _responses(futures: list[grpc.Future]):
        """Every rank's response, or the error that counts (lost_worker_first)."""
        responses, errors = [], []
        for future in futures:
            try:
                responses.append(future.result())
            except grpc.RpcError as e:
                errors.append(e)
        if errors:
            raise lost_worker_first(errors)
        return responses

    def load_model(self, config):
        tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        if tp * pp != len(self.stubs):
            raise ValueError(f"tensor_parallel_size {tp} × pipeline_parallel_size {pp} workers "
                             f"are needed, but {len(self.stubs)} worker addresses were given")
        self._output_rank = (pp - 1) * tp
        # Every rank joins the process group inside LoadModel: the calls run concurrently.
        responses = self._call_all("LoadModel", worker_pb2.LoadModelRequest(
            config=convert.engine_config_to_proto(config)))
        return convert.loaded_model_from_proto(responses[0])

    def _wait_for_steps_sent(self, timeout_s: float | None = None) -> None:
        """Adapters change between steps: a step sent under async scheduling may
        still use the one about to go. Its error is its caller's."""
        steps = self._steps
        if steps is not None:
            self._block_on(lambda: steps.wait_for_sent(timeout_s))

    def add_lora(self, lora_id, lora_path):
        self._wait_for_steps_sent()
        try:
            self._call_all("AddLora", worker_pb2.AddLoraRequest(lora_id=lora_id,
                                                                lora_path=lora_path))
        except grpc.RpcError as e:  # the worker's reason, to the caller unchanged
            raise from_rpc_error(e) from None

    def remove_lora(self, lora_id):
        self._wait_for_steps_sent()
        self._call_all("RemoveLora", worker_pb2.RemoveLoraRequest(lora_id=lora_id))

    def determine_num_kv_blocks(self):
        responses = self._call_all("DetermineNumKvBlocks",
                                   worker_pb2.DetermineNumKvBlocksRequest())
        return min(r.num_blocks for r in responses)

    def init_kv_cache(self, num_blocks):
        self._call_all("InitKvCache", worker_pb2.InitKvCacheRequest(num_blocks=num_blocks))

    def execute_model(self, scheduler_output):
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output):
        request = convert.scheduler_output_to_proto(scheduler_output)
        if self._loop is None:
            self._loop = asyncio._get_running_loop() or _private_loop()
            self._owns_loop = not self._loop.is_running()
        if self._on_step_loop():
            return self._send_step(request)
        return self._block_on(lambda: _coroutine(self._send_step, request))

    def _send_step(self, request) -> PendingStep:
        """Sends a step on the streams, opened at the first step and after a
        failure; runs on the steps' event loop."""
        if not self._step_channels:
            self._step_channels = [aio_channel(a, self.tls) for a in self.addresses]
        if self._steps is None or self._steps.error is not None:
            self._steps = StepStreams([worker_pb2_grpc.WorkerStub(c)
                                       for c in self._step_channels], self.rpc_timeout_s)
        steps, rank = self._steps, self._output_rank
        step = steps.send(request)

        def result() -> ModelRunnerOutput:
            if not self._on_step_loop():
                self._block_on(lambda: steps.wait(step))
            return convert.model_runner_output_from_proto(steps.output(step)[rank])
        return PendingStep(result, lambda: steps.wait(step))

    def _on_step_loop(self) -> bool:
        return self._loop is not None and asyncio._get_running_loop() is self._loop

    def _block_on(self, make_coroutine: Callable[[], Awaitable]):
        """Runs a coroutine on the steps' event loop from a thread that is not
        running it, and returns its result: the private loop is run here; a
        served engine core's is handed it (from a blocking call's thread)."""
        if self._on_step_loop():
            raise RuntimeError("a blocking wait for steps on the event loop that runs them")
        if self._owns_loop:
            return self._loop.run_until_complete(make_coroutine())
        return asyncio.run_coroutine_threadsafe(make_coroutine(), self._loop).result()

    def shutdown(self):
        # Not under a step still in flight (async scheduling leaves one when the
        # engine loop stops): its call would be cut while this process exits,
        # the suspect for an engine core that once exited with SIGSEGV after a
        # cut drain.
        self._wait_for_steps_sent(_SHUTDOWN_STEP_WAIT_S)
        if self._loop is not None:
            self._block_on(self._close_steps)  # a private loop stays open: _private_loop
        for channel in self.channels:
            channel.close()

    async def _close_steps(self) -> None:
        if self._steps is not None:
            self._steps.close()
        for channel in self._step_channels:
            await channel.close(grace=_SHUTDOWN_STEP_WAIT_S)


_private_loops = threading.local()


def _private_loop() -> asyncio.AbstractEventLoop:
    """The event loop this thread runs its step streams on when it runs none of
    its own: one a thread, reused by every executor there and never closed.
    grpc.aio can deliver a closed channel's last events after shutdown; on a
    closed loop they raise ("Event loop is closed") inside the next executor's
    loop, and asyncio logs the error with the frames of the step then running
    (a handler that keeps records, as pytest's does, keeps that engine core)."""
    loop = getattr(_private_loops, "loop", None)
    if loop is None:
        loop = _private_loops.loop = asyncio.new_event_loop()
    return loop


async def _coroutine(fn: Callable, *args):
    """fn(*args) as a coroutine: sync code run where an event loop is running."""
    return fn(*args)
