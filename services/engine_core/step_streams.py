"""StepStreams: the engine core's steps on one ExecuteModelStream per worker.

The streams are grpc.aio calls on one event loop: the served engine core's own
(its steps' outputs are awaited between its clients' calls, with no thread
handing them over), or a private one that a synchronous caller runs.
"""
from __future__ import annotations

import asyncio

import grpc

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
        self._call = stub.ExecuteModelStream()
        self._requests: asyncio.Queue = asyncio.Queue()
        # A task writes the steps in order, so that sending one never waits.
        self._writer = asyncio.ensure_future(self._write_all())

    def send(self, request) -> None:
        self._requests.put_nowait(request)

    async def receive(self):
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise StreamEnded()
        return response

    def close(self) -> None:
        """Ends the steps sent: the worker finishes those it has, then the call."""
        self._requests.put_nowait(_END)

    def cancel(self) -> None:
        """Cuts the call: the worker drops the steps it has not begun."""
        self._call.cancel()
        self._writer.cancel()

    async def _write_all(self) -> None:
        try:
            while (request := await self._requests.get()) is not _END:
                await self._call.write(request)
            await self._call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call failed or was cut: its reader raises why


class StepStreams:
    """A stream per worker, opened together and failing together, on the running
    event loop; every method runs there. Steps are numbered from 1 as sent;
    wait(n) reads every worker's outputs in order up to step n's, and output(n)
    takes them. When one worker's stream fails, every step not read yet fails
    with its error, the others are cut, and the executor opens new ones. A step
    whose outputs have not all come step_timeout_s after its reading began fails
    the same way, with StepTimedOut."""

    def __init__(self, stubs: list, step_timeout_s: float):
        self._streams = [_WorkerStream(stub) for stub in stubs]
        self.timeout_s = step_timeout_s
        self.sent = 0
        self._read = 0
        self._outputs: dict[int, list] = {}  # read, not yet taken
        self.error: grpc.RpcError | None = None
        self._reading = asyncio.Lock()  # the engine's wait() and a LoRA change's

    def send(self, request) -> int:
        """Sends a step to every worker; its number."""
        for stream in self._streams:
            stream.send(request)
        self.sent += 1
        return self.sent

    async def wait(self, step: int) -> None:
        """Reads the outputs of every step up to `step`, or until the streams
        fail; never raises their error (output() does)."""
        async with self._reading:
            while self._read < step and self.error is None:
                await self._read_next()

    def output(self, step: int) -> list:
        """Every worker's output of a step waited for, in rank order; raises the
        streams' error if they failed before this step's outputs were read."""
        if step in self._outputs:
            return self._outputs.pop(step)
        if self.error is None:
            raise RuntimeError(f"step {step}'s output was taken before it was read")
        raise self.error

    async def wait_for_sent(self, timeout_s: float | None = None) -> None:
        """Reads the outputs of every step sent (kept for output()), for at most
        timeout_s; a failure is left for output() to raise."""
        try:
            await asyncio.wait_for(self.wait(self.sent), timeout_s)
        except asyncio.TimeoutError:  # the read it cut cancelled its call
            self.cancel(StepTimedOut(self._read + 1, timeout_s))

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

    async def _read_next(self) -> None:
        """Reads the next step's output of every stream, or fails them all."""
        outputs, errors = [], []
        try:
            async with asyncio.timeout(self.timeout_s):
                for stream in self._streams:
                    try:
                        outputs.append(await stream.receive())
                    except grpc.RpcError as e:
                        errors.append(e)
        except TimeoutError:
            errors = [StepTimedOut(self._read + 1, self.timeout_s)]
        except asyncio.CancelledError:
            if self.error is None:  # not cut by cancel(): this task is cancelled
                raise
        if self.error is None and errors:
            self.cancel(lost_worker_first(errors))
        if self.error is None:
            self._read += 1
            self._outputs[self._read] = outputs

    def cancel(self, error: grpc.RpcError) -> None:
        """Cuts every stream: the steps not read yet fail with `error`."""
        self.error = error
        for stream in self._streams:
            stream.cancel()


def lost_worker_first(errors: list[grpc.RpcError]) -> grpc.RpcError:
    """The error of a call to every worker that some failed: a lost worker
    (UNAVAILABLE), whose loss the others' errors (a collective cut short) follow
    from, or else the first."""
    return next((e for e in errors if e.code() == grpc.StatusCode.UNAVAILABLE), errors[0])
