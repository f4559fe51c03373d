"""Times the phases of a run and prints one progress line per phase."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()
        self.note = ""  # what the phase found, set inside it, shown on its line
        # Put before every phase name, so runs of one step in another dtype keep apart.
        self.prefix = ""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.note = ""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.record(name, seconds)
        total = time.perf_counter() - self._start
        note = f": {self.note}" if self.note else ""
        print(f"[bench {total:6.1f}s] {self.prefix}{name} ({seconds:.1f}s){note}", flush=True)

    def record(self, name: str, seconds: float) -> None:
        """A phase's time, under the current prefix."""
        self.seconds[self.prefix + name] = seconds

    @contextmanager
    def prefixed(self, prefix: str) -> Iterator[None]:
        """Every phase inside is named `prefix + name`."""
        old, self.prefix = self.prefix, prefix
        try:
            yield
        finally:
            self.prefix = old
