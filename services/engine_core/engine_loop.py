"""EngineLoop: runs an EngineCore in a busy-loop thread and streams outputs to asyncio.

The thread owns the EngineCore; other threads talk to it only through the inbox.
It blocks on the inbox when there is no work, and otherwise steps as fast as the
workers go, taking new requests and aborts between steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc
from typing import AsyncIterator, Callable

from services.common.errors import FailedPrecondition, LLMServeError, Unavailable
from services.common.futures import run_into_future
from services.common.lora import LoRARequest
from services.common.request_types import EngineCoreOutput, EngineCoreRequest, EngineStats
from services.engine_core.engine_core import EngineCore
from services.engine_core.metrics import EngineCoreMetrics

logger = logging.getLogger(__name__)
# How long a failed step waits for its workers to be restarted (by `llmserve
# serve`, or Kubernetes) before failing the requests in flight.
WORKER_RECOVERY_TIMEOUT_S = 120.0


@dataclass
class _OutputStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # of EngineCoreOutput, or an exception that ends the stream


class EngineLoop:
    def __init__(self, core: EngineCore, metrics: EngineCoreMetrics | None = None):
        self.core = core
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _OutputStream] = {}  # touched by the loop thread only
        self._stopped = False
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grammar-compiler")
        self.draining = False  # shutting down: new requests are refused
        self._thread = threading.Thread(target=self._run, name="engine-core-loop", daemon=True)
        self._thread.start()

    # ---- asyncio side ------------------------------------------------------------

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Adds the request and yields its outputs; leaving early aborts it."""
        if self.draining:
            raise Unavailable("this engine core is shutting down; send the request to another")
        stream = _OutputStream(asyncio.get_running_loop(), asyncio.Queue())
        grammar = await self._compile_grammar(request)
        await self._call(lambda: self._add(request, stream, grammar))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(lambda: self._abort([request.request_id]))

    async def _compile_grammar(self, request: EngineCoreRequest):
        """A structured-outputs request's grammar, compiled on a thread of its own
        so that a slow compile never holds up the other requests' steps."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(
            self._grammar_pool, self.core.grammar_compiler.compile, constraint)

    async def add_lora(self, lora: LoRARequest) -> None:
        await self._call(lambda: self.core.add_lora(lora))

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda: self.core.remove_lora(name))

    async def abort(self, request_ids: list[str]) -> None:
        await self._call(lambda: self._abort(request_ids))

    async def reset_prefix_cache(self) -> None:
        if not await self._call(self.core.reset_prefix_cache):
            raise FailedPrecondition("requests still hold KV blocks; retry when idle")

    def start_draining(self) -> None:
        self.draining = True

    def num_in_flight(self) -> int:
        # A read of a dict the loop thread changes: its size is enough here.
        return len(self._streams)

    def stats(self) -> EngineStats:
        # Plain reads of counters the loop thread updates; no lock needed.
        return self.core.stats()

    def shutdown(self) -> None:
        self._stopped = True  # also ends a wait for workers to recover
        self._inbox.put(self._stop)
        self._thread.join(timeout=30)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.core.shutdown()

    async def _call(self, fn: Callable[[], object]) -> object:
        """Runs fn on the loop thread between steps and returns its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(lambda: run_into_future(future, fn))
        return await asyncio.wrap_future(future)

    # ---- loop thread -------------------------------------------------------------

    def _add(self, request: EngineCoreRequest, stream: _OutputStream, grammar) -> None:
        self.core.add_request(request, grammar)
        self._streams[request.request_id] = stream

    def _abort(self, request_ids: list[str]) -> None:
        self._dispatch(self.core.abort_requests(request_ids))

    def _stop(self) -> None:
        self._stopped = True

    def _run(self) -> None:
        while not self._stopped:
            # Block only when idle; otherwise take whatever arrived and step.
            block = not self.core.has_work()
            try:
                self._inbox.get(block=block)()
                while True:
                    self._inbox.get_nowait()()
            except queue.Empty:
                pass
            if self._stopped or not self.core.has_work():
                continue
            try:
                self._step()
            except Exception as e:
                if not (_worker_lost(e) and self._recover_workers()):
                    logger.exception("engine step failed; failing all live requests")
                    self._fail_all(e)

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.core.step()
        if self.metrics is not None and self.core.num_scheduled_tokens_last_step:
            self.metrics.observe_step(time.perf_counter() - start,
                                      self.core.num_scheduled_tokens_last_step)
        self._dispatch(outputs)

    def _recover_workers(self) -> bool:
        """Retries EngineCore.recover_workers, with backoff, until the workers are
        back (True) or WORKER_RECOVERY_TIMEOUT_S has passed (False). Requests wait
        meanwhile; new ones and aborts are taken once the loop steps again."""
        logger.error("a worker is gone; waiting for it to come back")
        deadline = time.monotonic() + WORKER_RECOVERY_TIMEOUT_S
        delay = 0.5
        while not self._stopped:
            try:
                self.core.recover_workers()
                return True
            except NotImplementedError:
                return False
            except Exception as e:
                if time.monotonic() + delay > deadline:
                    logger.error("the workers did not come back in %.0f s: %s",
                                 WORKER_RECOVERY_TIMEOUT_S, e)
                    return False
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
        return False

    def _fail_all(self, error: Exception) -> None:
        self.core.abort_requests(list(self._streams))
        wrapped = error if isinstance(error, LLMServeError) else Unavailable(
            f"the engine core's workers failed: {error}")
        for stream in self._streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, wrapped)
        self._streams.clear()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        """Hands outputs to their streams, one wake-up per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineCoreOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)


def _worker_lost(error: Exception) -> bool:
    """A step failed because a worker went away (not a bug, which recovering the
    workers would only repeat)."""
    return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, EngineCoreOutput]]) -> None:
    for q, output in items:
        q.put_nowait(output)

