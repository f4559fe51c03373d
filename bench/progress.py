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

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.note = ""
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        total = time.perf_counter() - self._start
        note = f": {self.note}" if self.note else ""
        print(f"[bench {total:6.1f}s] {name} ({self.seconds[name]:.1f}s){note}", flush=True)
