"""MainThreadRunner: runs the worker's model calls on the process's main thread.

torch's CPU kernels ran about 20% slower when called from a secondary thread
(GNU OpenMP thread teams), so the gRPC server runs its asyncio loop on a
background thread and hands every model call to the main thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from typing import Any, Callable

from services.common.futures import run_into_future


class MainThreadRunner:
    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Awaitable from any event loop; fn runs on the thread in serve_forever()."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def serve_forever(self) -> None:
        """Call on the main thread: runs submitted calls until stop()."""
        while (item := self._queue.get()) is not None:
            fn, args, future = item
            run_into_future(future, fn, *args)

    def stop(self) -> None:
        self._queue.put(None)
