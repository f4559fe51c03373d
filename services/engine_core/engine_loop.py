"""EngineLoop: runs an EngineCore as an asyncio task and streams its outputs.

The task owns the EngineCore; callers talk to it only through the inbox. It
waits on the inbox when there is no work, and otherwise steps as fast as the
workers go, taking new requests and aborts between steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import collections
import contextvars
import copy
import functools
import logging
import threading
import time
from dataclasses import dataclass

import grpc
from typing import AsyncIterator, Callable, Protocol

from services.common.errors import FailedPrecondition, LLMServeError, Unavailable
from services.common.futures import run_into_future
from services.common.lora import LoRARequest
from services.common.request_types import EngineCoreOutput, EngineCoreRequest, EngineStats
from services.engine_core.engine_core import EngineCore
from services.engine_core.grammar_compiler import MAX_CHILDREN
from services.engine_core.metrics import EngineCoreMetrics

logger = logging.getLogger(__name__)
# How long a failed step waits for its workers to be restarted (by `llmserve
# serve`, or Kubernetes) before failing the requests in flight.
WORKER_RECOVERY_TIMEOUT_S = 120.0


class OutputSink(Protocol):
    """Where the outputs of some requests go: one request's stream (generate), or
    a session carrying many. Both methods are called on `loop`, once per step
    with everything of that step for this sink."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, outputs: list[EngineCoreOutput]) -> None: ...

    def fail(self, request_ids: list[str], error: LLMServeError) -> None:
        """The requests ended with `error` (their workers failed)."""


@dataclass
class _RequestStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of EngineCoreOutput, or an exception that ends the stream

    def deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            self.queue.put_nowait(output)

    def fail(self, request_ids: list[str], error: LLMServeError) -> None:
        self.queue.put_nowait(error)


class EngineLoop:
    """Runs the EngineCore as a task on the event loop of its first caller (the
    served engine core's). Between steps it takes the calls queued in its inbox;
    while a step's output travels it awaits it, so the loop serves the clients
    meanwhile, with no thread handing outputs over. Steps of executors whose
    workers run inside the call, and the calls that block (adapters, recovery,
    shutdown), run on one thread of their own while the task awaits them."""

    def __init__(self, core: EngineCore, metrics: EngineCoreMetrics | None = None):
        self.core = core
        if metrics is not None:
            core.on_step_done = metrics.observe_step
            core.on_step_sent = metrics.observe_step_sent
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._sinks: dict[str, OutputSink] = {}  # by request id; the task only
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None  # set: the inbox has calls
        self._blocking = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-core-blocking")
        # A thread per compile in flight, each waiting on a compiler's child process.
        self._grammar_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CHILDREN, thread_name_prefix="grammar-compile")
        self.draining = False  # shutting down: new requests are refused

    # ---- the callers' side ---------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest, sink: OutputSink) -> None:
        """Adds the request; its outputs go to sink until one is finished."""
        if self.draining:
            raise Unavailable("this engine core is shutting down; send the request to another")
        grammar = await self._compile_grammar(request)
        await self._call(lambda: self._add(request, sink, grammar))

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Adds the request and yields its outputs; leaving early aborts it."""
        stream = _RequestStream(asyncio.get_running_loop(), asyncio.Queue())
        await self.add_request(request, stream)
        finished = False
        try:
            async for output in outputs_until_finished(stream.queue):
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort_soon([request.request_id])

    async def _compile_grammar(self, request: EngineCoreRequest):
        """A structured-outputs request's grammar, compiled off the event loop (in
        a child process, within the time limit), so that a slow compile holds up
        neither the other requests' steps nor their compiles. A caller that
        leaves stops its compile."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return None
        cancelled = threading.Event()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._grammar_threads, self.core.grammar_compiler.compile, constraint, cancelled)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def add_lora(self, lora: LoRARequest) -> None:
        await self._call(lambda: self.core.add_lora(lora), blocking=True)

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda: self.core.remove_lora(name), blocking=True)

    async def abort(self, request_ids: list[str]) -> None:
        await self._call(lambda: self._abort(request_ids))

    def abort_soon(self, request_ids: list[str]) -> None:
        """Aborts between the next steps, after everything queued before it (an add
        queued earlier included), without waiting."""
        self._put(lambda: self._abort(request_ids))

    async def reset_prefix_cache(self) -> None:
        if not await self._call(self.core.reset_prefix_cache):
            raise FailedPrecondition("requests still hold KV blocks; retry when idle")

    def start_draining(self) -> None:
        self.draining = True

    def num_in_flight(self) -> int:
        return len(self._sinks)

    def stats(self) -> EngineStats:
        # Plain reads of counters that steps run elsewhere may update: no lock needed.
        return self.core.stats()

    async def shutdown(self) -> None:
        """Stops after the step in progress, then shuts the core down."""
        self._stopped = True  # also ends a wait for workers to recover
        if self._task is not None and not self._task.done():
            self._wake.set()
            await asyncio.wait([self._task], timeout=30)
        await asyncio.get_running_loop().run_in_executor(self._blocking, self.core.shutdown)
        self._blocking.shutdown(wait=False)
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[[], object], blocking: bool = False) -> object:
        """Runs fn between steps and returns its result; a blocking fn on the
        blocking thread, the task awaiting it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call = functools.partial(run_into_future, future, fn)
        self._put(self._run_blocking(call) if blocking else call)
        return await asyncio.wrap_future(future)

    def _put(self, call) -> None:
        """Queues a call for the task (a coroutine function if it blocks),
        starting the task on the first one (on its caller's event loop)."""
        if self._task is None or self._task.done():  # the first call, or its loop ended
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            # In a context of its own, not its first caller's: its step spans
            # would otherwise be children of that request's span.
            self._task = self._loop.create_task(self._run(), name="engine-core-loop",
                                                context=contextvars.Context())
        self._inbox.append(call)
        self._wake.set()

    def _run_blocking(self, call: Callable[[], None]):
        async def run() -> None:
            await self._loop.run_in_executor(self._blocking, call)
        return run

    # ---- the task ------------------------------------------------------------------

    def _add(self, request: EngineCoreRequest, sink: OutputSink, grammar) -> None:
        self.core.add_request(request, grammar)
        self._sinks[request.request_id] = sink

    def _abort(self, request_ids: list[str]) -> None:
        self._dispatch(self.core.abort_requests(request_ids))

    async def _run(self) -> None:
        while not self._stopped:
            # Wait only when idle; otherwise take whatever arrived and step.
            if not self._inbox and not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
            await self._take_inbox()
            if self._stopped or not self.core.has_work():
                continue
            try:
                self._dispatch(await self._step())
            except Exception as e:
                if not (_worker_lost(e) and await self._recover_workers()):
                    logger.exception("engine step failed; failing all live requests")
                    self._fail_all(e)

    async def _take_inbox(self) -> None:
        while self._inbox:
            call = self._inbox.popleft()
            result = call()
            if asyncio.iscoroutine(result):
                await result

    async def _step(self) -> list[EngineCoreOutput]:
        if self.core.executor.steps_on_event_loop:
            return await self.core.step_async()
        # The step runs inside the call: elsewhere, so that the loop serves on.
        step = self._loop.run_in_executor(self._blocking, self.core.step)
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            # The event loop is ending (asyncio.run cancels its tasks): the step
            # runs on, so it is waited for; a task a later loop starts would
            # otherwise touch the core beside it, and the workers would not hear
            # of the requests it reports finished.
            await step
            raise

    async def _recover_workers(self) -> bool:
        """Retries EngineCore.recover_workers, with backoff, until the workers are
        back (True) or WORKER_RECOVERY_TIMEOUT_S has passed (False). Requests wait
        meanwhile; new ones and aborts are taken once the loop steps again."""
        logger.error("a worker is gone; waiting for it to come back")
        deadline = time.monotonic() + WORKER_RECOVERY_TIMEOUT_S
        delay = 0.5
        while not self._stopped:
            try:
                await self._loop.run_in_executor(self._blocking, self.core.recover_workers)
                return True
            except NotImplementedError:
                return False
            except Exception as e:
                if time.monotonic() + delay > deadline:
                    logger.error("the workers did not come back in %.0f s: %s",
                                 WORKER_RECOVERY_TIMEOUT_S, e)
                    return False
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        return False

    def _fail_all(self, error: Exception) -> None:
        self.core.abort_requests(list(self._sinks))
        wrapped = error if isinstance(error, LLMServeError) else Unavailable(
            f"the engine core's workers failed: {error}")
        # A copy per sink: one exception instance raised in many tasks would
        # gather all their tracebacks.
        _call_per_loop([(sink, [request_id]) for request_id, sink in self._sinks.items()],
                       lambda sink, request_ids: sink.fail(request_ids, copy.copy(wrapped)))
        self._sinks.clear()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        """Hands outputs to their sinks: one call per sink, and one callback per
        event loop, per step."""
        items = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            items.append((sink, [output]))
        _call_per_loop(items, lambda sink, sink_outputs: sink.deliver(sink_outputs))


async def outputs_until_finished(queue: asyncio.Queue) -> AsyncIterator[EngineCoreOutput]:
    """One request's outputs from its queue, up to its finished one; an exception
    put in the queue ends them by being raised."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return


def _worker_lost(error: Exception) -> bool:
    """A step failed because a worker went away (not a bug, which recovering the
    workers would only repeat)."""
    return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    if asyncio._get_running_loop() is loop:  # the engine's own: no wake-up needed
        loop.call_soon(fn, *args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _call_per_loop(items: list[tuple[OutputSink, list]], call) -> None:
    """call(sink, values) once per sink, with the values of all its items, from one
    callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, dict[int, tuple[OutputSink, list]]] = {}
    for sink, values in items:
        per_sink = by_loop.setdefault(sink.loop, {})
        per_sink.setdefault(id(sink), (sink, []))[1].extend(values)

    def call_all(per_sink: dict[int, tuple[OutputSink, list]]) -> None:
        for sink, values in per_sink.values():
            call(sink, values)
    for loop, per_sink in by_loop.items():
        _call_soon(loop, call_all, per_sink)
