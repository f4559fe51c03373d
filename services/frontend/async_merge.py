"""Interleaving several async streams as their items arrive."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

T = TypeVar("T")
_DONE = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) as items arrive from any stream. The first failure
    ends the merge with that error; leaving early, or a failure, closes every
    stream (which aborts what they stand for, e.g. engine requests)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
