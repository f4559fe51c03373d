"""Tests wait on conditions, not on time: poll until one holds. The deadline
only bounds how long a failing test takes; a busy machine merely polls longer."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")
DEADLINE_S = 60.0
_POLL_S = 0.02


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = DEADLINE_S) -> T:
    """condition()'s first truthy value; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s:g} s")
        time.sleep(_POLL_S)
    return value


async def until(condition: Callable[[], T], what: str, timeout_s: float = DEADLINE_S) -> T:
    """wait_until inside an event loop: the loop runs while it polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s:g} s")
        await asyncio.sleep(_POLL_S / 4)
    return value
