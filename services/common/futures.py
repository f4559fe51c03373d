"""Running a call on one thread for a caller awaiting it on another."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable


def run_into_future(future: concurrent.futures.Future, fn: Callable[..., Any], *args: Any) -> None:
    """Runs fn(*args) into future, unless the caller already gave up (cancelled it,
    e.g. its RPC was cancelled): then fn does not run at all."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:  # handed to the awaiting caller
        future.set_exception(e)
    else:
        future.set_result(result)
