"""The engine core's steps on one gRPC stream per worker (GrpcExecutor against a
real WorkerServicer in this process, behind the services' error interceptor, its
worker a fake): outputs in the order sent, a failed step's status to its caller,
a new stream after it, a worker that goes away read as UNAVAILABLE (what
recovery waits for), one that hangs as DEADLINE_EXCEEDED, and a step that is
not a valid message as INVALID_ARGUMENT. Both ways of calling it: blocking (the
offline LLM's, on a private event loop), and on a running event loop, its
outputs awaited (the served engine core's)."""
import asyncio
import threading
from contextlib import contextmanager

import grpc
import pytest

from services.common.errors import ErrorMappingInterceptor, FailedPrecondition
from services.common.pb import worker_pb2_grpc
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.engine_core.executor import GrpcExecutor
from services.worker.servicer import WorkerServicer
from tests.unit.aio_server_thread import aio_server_thread


class FakeWorker:
    """Emits each step's id as its token; fails the step numbered fail_at; waits
    at `gate` before each step."""

    def __init__(self):
        self.ran: list[int] = []
        self.fail_at = None
        self.gate = threading.Event()
        self.gate.set()
        self.loras: list[tuple[int, list[int]]] = []  # (id, the steps run before it)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.gate.wait(timeout=10)
        step_id = scheduler_output.step_id
        self.ran.append(step_id)
        if step_id == self.fail_at:
            raise FailedPrecondition(f"step {step_id} cannot run")
        return ModelRunnerOutput(sampled_token_ids={"r": [step_id]})

    def add_lora(self, lora_id: int, lora_path: str) -> None:
        self.loras.append((lora_id, list(self.ran)))


class CountingServicer(WorkerServicer):
    def __init__(self, worker):
        super().__init__(worker)
        self.streams = 0

    async def ExecuteModelStream(self, request_iterator, context):
        self.streams += 1
        async for output in super().ExecuteModelStream(request_iterator, context):
            yield output


@contextmanager
def served(worker: FakeWorker):
    """The servicer behind the services' interceptor; yields (servicer, address,
    stop), stop(grace_s) stopping the server early."""
    servicer = CountingServicer(worker)
    with aio_server_thread(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(
            servicer, server), [ErrorMappingInterceptor()]) as (address, stop):
        yield servicer, address, stop


def step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, num_scheduled_tokens={"r": 1})


def tokens(pending) -> list[int]:
    return pending.result().sampled_token_ids["r"]


@pytest.fixture
def worker():
    return FakeWorker()


def test_steps_in_flight_come_back_in_order_on_one_stream(worker):
    with served(worker) as (servicer, address, _):
        executor = GrpcExecutor([address])
        worker.gate.clear()  # all three sent before the first runs
        pending = [executor.execute_model_async(step(i)) for i in (1, 2, 3)]
        worker.gate.set()
        assert [tokens(p) for p in pending] == [[1], [2], [3]]
        assert tokens(executor.execute_model_async(step(4))) == [4]
        assert worker.ran == [1, 2, 3, 4]
        assert servicer.streams == 1
        executor.shutdown()


def test_executors_one_after_another_in_a_thread_step_on_one_loop_left_open(worker, caplog):
    """The blocking caller's private loop outlives an executor's shutdown and serves
    the next executor in the thread, so grpc.aio's late events for a closed
    channel land on an open loop, not raise "Event loop is closed" inside the next
    one's step (logged at ERROR with that step's frames). Another thread has its own."""
    with served(worker) as (_, address, _):
        loops = []
        for step_id in (1, 2):
            executor = GrpcExecutor([address])
            assert tokens(executor.execute_model_async(step(step_id))) == [step_id]
            executor.shutdown()
            loops.append(executor._loop)
        assert loops[0] is loops[1] and not loops[0].is_closed()
        other = []
        thread = threading.Thread(target=lambda: other.append(run_one_step(address)))
        thread.start()
        thread.join(timeout=30)
        assert other and other[0] is not loops[0]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def run_one_step(address: str):
    executor = GrpcExecutor([address])
    assert tokens(executor.execute_model_async(step(9))) == [9]
    executor.shutdown()
    return executor._loop


def test_a_failed_step_carries_its_status_and_the_next_step_opens_a_new_stream(worker):
    worker.fail_at = 2
    with served(worker) as (servicer, address, _):
        executor = GrpcExecutor([address])
        worker.gate.clear()
        pending = [executor.execute_model_async(step(i)) for i in (1, 2, 3)]
        worker.gate.set()
        assert tokens(pending[0]) == [1]
        for failed in pending[1:]:  # the step, and the one sent after it
            with pytest.raises(grpc.RpcError) as error:
                failed.result()
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "step 2 cannot run" in error.value.details()
        assert tokens(executor.execute_model_async(step(4))) == [4]
        assert servicer.streams == 2
        executor.shutdown()


def test_an_adapter_changes_after_the_step_sent_and_leaves_its_output(worker):
    with served(worker) as (_, address, _):
        executor = GrpcExecutor([address])
        worker.gate.clear()
        pending = executor.execute_model_async(step(1))
        threading.Timer(0.2, worker.gate.set).start()
        executor.add_lora(7, "/adapters/seven")  # waits for step 1
        assert worker.loras == [(7, [1])]
        assert tokens(pending) == [1]
        executor.shutdown()


def test_a_worker_that_stops_under_an_open_stream_reads_as_unavailable(worker):
    with served(worker) as (_, address, stop):
        executor = GrpcExecutor([address])
        assert tokens(executor.execute_model_async(step(1))) == [1]
        stop(0)
        with pytest.raises(grpc.RpcError) as error:
            executor.execute_model_async(step(2)).result()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        executor.shutdown()


def test_a_step_the_worker_does_not_answer_in_time_fails_and_the_next_gets_a_new_stream(worker):
    with served(worker) as (servicer, address, _):
        executor = GrpcExecutor([address], rpc_timeout_s=0.5)
        worker.gate.clear()  # the worker hangs in step 1
        with pytest.raises(grpc.RpcError) as error:
            executor.execute_model_async(step(1)).result()
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no output of step 1 from the workers in 0.5 s" in error.value.details()
        worker.gate.set()
        assert tokens(executor.execute_model_async(step(2))) == [2]
        assert servicer.streams == 2
        executor.shutdown()


def test_on_a_running_event_loop_steps_are_awaited_and_blocking_calls_wait_from_a_thread(worker):
    with served(worker) as (servicer, address, _):
        executor = GrpcExecutor([address])

        async def main():
            loop = asyncio.get_running_loop()
            worker.gate.clear()
            pending = [executor.execute_model_async(step(i)) for i in (1, 2)]
            with pytest.raises(RuntimeError, match="taken before it was read"):
                pending[0].result()  # on the loop, a step's output is awaited first
            # An adapter's change, on another thread, waits for both steps sent.
            adding = loop.run_in_executor(None, executor.add_lora, 7, "/adapters/seven")
            loop.call_later(0.2, worker.gate.set)
            await adding
            assert worker.loras == [(7, [1, 2])]
            for p in pending:
                await p.wait()
            later = executor.execute_model_async(step(3))
            await later.wait()
            await loop.run_in_executor(None, executor.shutdown)
            return [tokens(p) for p in [*pending, later]]
        assert asyncio.run(main()) == [[1], [2], [3]]
        assert servicer.streams == 1


def test_on_a_running_event_loop_a_step_not_answered_in_time_fails(worker):
    with served(worker) as (servicer, address, _):
        executor = GrpcExecutor([address], rpc_timeout_s=0.5)

        async def main():
            worker.gate.clear()  # the worker hangs in step 1
            hung = executor.execute_model_async(step(1))
            await hung.wait()
            with pytest.raises(grpc.RpcError) as error:
                hung.result()
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            worker.gate.set()
            next_step = executor.execute_model_async(step(2))
            await next_step.wait()
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
            return tokens(next_step)
        assert asyncio.run(main()) == [2]
        assert servicer.streams == 2


def test_a_step_that_is_not_a_valid_message_is_invalid_argument(worker):
    with served(worker) as (_, address, _):
        with grpc.insecure_channel(address) as channel:
            call = channel.stream_stream("/llmserve.worker.v1.Worker/ExecuteModelStream")
            with pytest.raises(grpc.RpcError) as error:
                list(call(iter([b"\xff\xff"]), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request: is not a valid message" in error.value.details()
        assert "SchedulerOutput" in error.value.details()
        assert worker.ran == []
