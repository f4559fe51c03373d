"""Waiting queues, one per scheduling policy."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from services.engine_core.request import Request


class FCFSQueue:
    """First come, first served; preempted requests go back to the front."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest priority value first, then earliest arrival (vLLM's order). A
    preempted request keeps its place by (priority, arrival) when it returns."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0  # tie-breaker: never compare Requests

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


def make_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    queues = {"fcfs": FCFSQueue, "priority": PriorityQueue}
    if policy not in queues:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {sorted(queues)}")
    return queues[policy]()
