"""StepOrder: the worker's ExecuteModel calls, one at a time, in the engine core's order."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable

from services.common.errors import FailedPrecondition
from services.common.futures import run_into_future

_Step = tuple[Callable[..., Any], tuple, concurrent.futures.Future]


class StepOrder:
    """With async scheduling the engine core sends step N + 1 while step N runs,
    and two calls in flight may reach their handlers in either order: a step runs
    once every step numbered before it has run. Steps are numbered by the
    scheduler (SchedulerOutput.step_id); InitKvCache says which comes next.

    The steps run through `run` (the worker's main thread) in one drain that
    takes each next step as soon as the one before it ends, without a round trip
    through the event loop: served at one stream, the main thread's idle time
    between steps fell from 0.81-0.89 to 0.69-0.73 ms (bench/NOTES.md)."""

    def __init__(self, run: Callable[..., Awaitable]):
        self._run = run
        self._lock = threading.Lock()  # the event loop's thread and the drain's
        self._next = 1
        self._pending: dict[int, _Step] = {}
        self._draining = False
        self._drains: set[asyncio.Future] = set()  # kept referenced until done

    async def execute(self, step_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) once the steps before step_id have run; its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending[step_id] = (fn, args, future)
            self._start_drain_locked()
        return await asyncio.wrap_future(future)

    async def reset(self, next_step_id: int) -> None:
        """The KV cache was set up again: steps sent before it are refused, and
        next_step_id comes next."""
        with self._lock:
            stale, self._pending = self._pending, {}
            self._next = next_step_id
        for _, _, future in stale.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(FailedPrecondition(
                    "this step was sent before the worker's KV cache was set up again"))

    def _start_drain_locked(self) -> None:
        if self._draining or self._ready_locked() is None:
            return
        self._draining = True
        drain = asyncio.ensure_future(self._run(self._drain))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)

    def _ready_locked(self) -> int | None:
        """The pending step that may run now: the lowest, if nothing before it is missing."""
        if not self._pending:
            return None
        lowest = min(self._pending)
        return lowest if lowest <= self._next else None

    def _drain(self) -> None:
        """On the thread of `run`: runs ready steps until the next has not arrived."""
        while True:
            with self._lock:
                step_id = self._ready_locked()
                if step_id is None:
                    self._draining = False
                    return
                fn, args, future = self._pending.pop(step_id)
            run_into_future(future, fn, *args)
            with self._lock:
                self._next = max(self._next, step_id + 1)
