"""StepStreams: the engine core's steps on one ExecuteModelStream per worker."""
from __future__ import annotations

import queue
import threading

import grpc

from services.engine_core.step_deadline import StepDeadline

_END = object()  # closes a stream's requests


class StreamEnded(grpc.RpcError):
    """A worker's stream ended before a step's output: the worker went away
    (UNAVAILABLE, as for a call to a worker that is gone)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the worker's step stream ended before a step's output"

    def __str__(self) -> str:
        return self.details()


class StepTimedOut(grpc.RpcError):
    """No output of a step from some worker within the deadline: a worker hangs
    (DEADLINE_EXCEEDED, as a unary call's deadline gives)."""

    def __init__(self, step: int, timeout_s: float):
        self.step, self.timeout_s = step, timeout_s

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return (f"no output of step {self.step} from the workers in {self.timeout_s:g} s: "
                "a worker hangs")

    def __str__(self) -> str:
        return self.details()


class _WorkerStream:
    """One worker's stream: steps sent in order, outputs read in the same order."""

    def __init__(self, stub):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        # gRPC's own thread sends what the iterator yields, as it is put here.
        self._responses = stub.ExecuteModelStream(iter(self._requests.get, _END))

    def send(self, request) -> None:
        self._requests.put(request)

    def receive(self):
        try:
            return next(self._responses)
        except StopIteration:
            raise StreamEnded() from None

    def close(self) -> None:
        """Ends the steps sent: the worker finishes those it has, then the call."""
        self._requests.put(_END)

    def cancel(self) -> None:
        """Cuts the call: the worker drops the steps it has not begun."""
        self._responses.cancel()


class StepStreams:
    """A stream per worker, opened together and failing together. Steps are
    numbered from 1 as sent; output(n) reads every worker's outputs in order up
    to step n's. When one worker's stream fails, every step not read yet fails
    with its error, the others are cut, and the executor opens new ones. A step
    whose outputs have not all come step_timeout_s after its reading began fails
    the same way, with StepTimedOut."""

    def __init__(self, stubs: list, step_timeout_s: float):
        self._streams = [_WorkerStream(stub) for stub in stubs]
        self.sent = 0
        self._read = 0
        self._outputs: dict[int, list] = {}  # read, not yet taken
        self.error: grpc.RpcError | None = None
        self._lock = threading.Lock()  # output() and a shutdown's wait_for_sent()
        self._deadline = StepDeadline(step_timeout_s, lambda: self.cancel(
            StepTimedOut(self._read + 1, step_timeout_s)))

    def send(self, request) -> int:
        """Sends a step to every worker; its number."""
        for stream in self._streams:
            stream.send(request)
        self.sent += 1
        return self.sent

    def output(self, step: int) -> list:
        """Every worker's output of a step sent, in rank order; raises the
        stream's error if it failed before this step's outputs were read."""
        self._read_through(step)
        if step in self._outputs:
            return self._outputs.pop(step)
        raise self.error

    def wait_for_sent(self, timeout_s: float | None = None) -> None:
        """Reads the outputs of every step sent (kept for output()), for at most
        timeout_s; a failure is left for output() to raise."""
        if timeout_s is None:
            return self._read_through(self.sent)
        reader = threading.Thread(target=self._read_through, args=(self.sent,), daemon=True)
        reader.start()
        reader.join(timeout_s)

    def close(self) -> None:
        self._deadline.stop()
        for stream in self._streams:
            stream.close()

    def _read_through(self, step: int) -> None:
        with self._lock:
            while self._read < step and self.error is None:
                self._deadline.begin()
                outputs, errors = self._receive_all()
                self._deadline.end()
                if errors:
                    # Streams the deadline cut fail with its error, not CANCELLED.
                    self.cancel(self.error or lost_worker_first(errors))
                    return
                self._read += 1
                self._outputs[self._read] = outputs

    def _receive_all(self) -> tuple[list, list[grpc.RpcError]]:
        """The next output of every stream, and the errors of those that failed."""
        outputs, errors = [], []
        for stream in self._streams:
            try:
                outputs.append(stream.receive())
            except grpc.RpcError as e:
                errors.append(e)
        return outputs, errors

    def cancel(self, error: grpc.RpcError) -> None:
        """Cuts every stream: the steps not read yet fail with `error`."""
        self.error = error
        self._deadline.stop()
        for stream in self._streams:
            stream.cancel()


def lost_worker_first(errors: list[grpc.RpcError]) -> grpc.RpcError:
    """The error of a call to every worker that some failed: a lost worker
    (UNAVAILABLE), whose loss the others' errors (a collective cut short) follow
    from, or else the first."""
    return next((e for e in errors if e.code() == grpc.StatusCode.UNAVAILABLE), errors[0])
