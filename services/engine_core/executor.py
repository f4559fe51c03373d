"""Executors: how the engine core reaches its workers (in this process, or over gRPC)."""
from __future__ import annotations

import abc
import concurrent.futures
from typing import Callable

import grpc

from services.common import convert
from services.common.config import EngineConfig
from services.common.errors import from_rpc_error
from services.common.futures import run_into_future
from services.common.ports import free_port
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.request_types import LoadedModel
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.common.tls import TlsConfig, sync_channel
from services.engine_core.step_streams import StepStreams, StreamEnded, lost_worker_first


# How long shutdown waits for the step in flight (a step takes milliseconds).
_SHUTDOWN_STEP_WAIT_S = 10.0


class PendingStep:
    """A step sent to the workers: result() waits for rank 0's output, or raises
    the step's error."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]):
        self._wait = wait

    def result(self) -> ModelRunnerOutput:
        return self._wait()


class Executor(abc.ABC):
    """Runs each step on every worker and returns the result of the last pipeline
    stage's first rank (rank 0 without pipeline parallelism)."""

    # Whether a step can run on the workers while the engine core schedules the
    # next one (async scheduling); not when the workers run inside the call.
    overlaps_steps = False

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

    def __init__(self, addresses: list[str], tls: TlsConfig = TlsConfig(),
                 rpc_timeout_s: float = 600.0):
        self.channels = [sync_channel(a, tls) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.rpc_timeout_s = rpc_timeout_s  # a call's deadline, and a step's output's
        self._steps: StepStreams | None = None
        # The rank whose step output counts: the last stage's first (ranks are
        # stage-major), set by load_model.
        self._output_rank = 0

    def wait_ready(self, timeout_s: float) -> None:
        for channel in self.channels:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)

    def reconnect(self, timeout_s: float = 5.0) -> None:
        if self._steps is not None and self._steps.error is None:
            self._steps.cancel(StreamEnded())  # a restarted worker's stream died with it
        self.wait_ready(timeout_s)

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
        if self._steps is not None:
            self._steps.wait_for_sent(timeout_s)

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
        if self._steps is None or self._steps.error is not None:
            # At the first step, and after a failure.
            self._steps = StepStreams(self.stubs, self.rpc_timeout_s)
        steps, rank = self._steps, self._output_rank
        step = steps.send(request)
        return PendingStep(
            lambda: convert.model_runner_output_from_proto(steps.output(step)[rank]))

    def shutdown(self):
        # Not under a step still in flight (async scheduling leaves one when the
        # engine loop stops): its RPC would be cut in gRPC's threads while this
        # process exits, the suspect for an engine core that once exited with
        # SIGSEGV after a cut drain.
        self._wait_for_steps_sent(_SHUTDOWN_STEP_WAIT_S)
        if self._steps is not None:
            self._steps.close()
        for channel in self.channels:
            channel.close()
