"""StepOrder: the worker's ExecuteModel calls, one at a time, in the engine core's order."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from services.common.errors import FailedPrecondition


class StepOrder:
    """With async scheduling the engine core sends step N + 1 while step N runs,
    and two calls in flight may reach their handlers in either order: a call
    waits until every step numbered before it has run. Steps are numbered by the
    scheduler (SchedulerOutput.step_id); InitKvCache says which comes next."""

    def __init__(self):
        self._next = 1
        self._running = False
        self._epoch = 0  # reset() count: a step sent before it is never run after
        self._changed = asyncio.Condition()

    async def reset(self, next_step_id: int) -> None:
        async with self._changed:
            self._next = next_step_id
            self._epoch += 1
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def turn(self, step_id: int) -> AsyncIterator[None]:
        epoch = self._epoch
        async with self._changed:
            await self._changed.wait_for(lambda: self._epoch != epoch or (
                not self._running and step_id <= self._next))
            if self._epoch != epoch:
                raise FailedPrecondition(
                    "this step was sent before the worker's KV cache was set up again")
            self._running = True
        try:
            yield
        finally:
            async with self._changed:
                self._running = False
                self._next = max(self._next, step_id + 1)
                self._changed.notify_all()
