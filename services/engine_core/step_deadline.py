"""StepDeadline: a limit on how long the engine core waits for a step's output."""
from __future__ import annotations

import threading
import time
from typing import Callable


class StepDeadline:
    """Calls on_expiry once when a wait (begin() to end()) lasts timeout_s. A step
    stream has no deadline of its own (it stays open for hours), and a worker that
    hangs without dying would otherwise hold the engine loop forever.

    One thread, started at the first wait. It sleeps untimed while nothing is
    awaited and wakes once per timeout_s while steps follow one another, so a
    step costs two uncontended locks, not a wake-up; only the first wait after
    an idle spell wakes it."""

    def __init__(self, timeout_s: float, on_expiry: Callable[[], None]):
        self.timeout_s = timeout_s
        self._on_expiry = on_expiry
        self._since: float | None = None  # when the wait in progress began
        self._idle = False  # the thread waits for a wait to begin
        self._stopped = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        with self._cond:
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="step-deadline",
                                                daemon=True)
                self._thread.start()
            elif self._idle:
                self._cond.notify()

    def end(self) -> None:
        with self._cond:
            self._since = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _watch(self) -> None:
        if self._expired():
            self._on_expiry()

    def _expired(self) -> bool:
        """Waits until a wait outlasts timeout_s (True) or stop() (False)."""
        with self._cond:
            while not self._stopped:
                if self._since is None:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                    continue
                left = self._since + self.timeout_s - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False
