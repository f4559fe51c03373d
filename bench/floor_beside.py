"""The one-stream floor timed again beside each one-stream run.

The floor section times the weight stream once, at the start of a run. On the
2-core VMs this bench runs on, memory reads swing 24-40 GB/s from one minute to
the next (bench/NOTES.md), so an inter-token latency measured ten minutes later
was held against another minute's memory: in one run the in-process ITL came in
at 0.89x that floor and the served one at 1.35x. Here the floor's per-token time
(the faster of the copy and the floor section's fastest one-row pass, as there)
is timed again just before and just after each one-stream run, and the ITL is
also given against the median of those timings."""
from __future__ import annotations

import statistics
from typing import Callable, TypeVar

import torch

from bench import floor_measure as fm
from bench.floor import COPY_BYTES, ModelShape

T = TypeVar("T")


class StreamFloor:
    """The model's linears at one row through one path, weights made once; each
    time() is one reading of the floor's per-token time."""

    def __init__(self, model_dir: str, floor: dict):
        dtype = getattr(torch, floor["dtype"])
        self.path = floor["passes"]["1"]["path"]  # the floor section's fastest at one row
        make = fm.gemm_paths(dtype)[self.path]
        weights = fm.make_weights(ModelShape.from_model_dir(model_dir).linears(), dtype)
        with torch.inference_mode():
            self._layers = [(name, w.shape[1], make(w)) for name, w in weights]
        self._inputs = {k: torch.randn(1, k).to(dtype) for _, k, _ in self._layers}
        self._bytes = floor["weight_bytes"]
        self.readings_s: list[float] = []
        self.passes_s: list[float] = []
        self.copy_gb_s: list[float] = []

    def time(self) -> float:
        """Seconds a token's weights take to stream now: the best one-row pass,
        or the copy's rate where that is faster (floor.stream_rate)."""
        self.passes_s.append(fm.best_pass(self._layers, self._inputs)["seconds"])
        self.copy_gb_s.append(fm.copy_bandwidth(COPY_BYTES))
        self.readings_s.append(min(self.passes_s[-1], self._bytes / (self.copy_gb_s[-1] * 1e9)))
        return self.readings_s[-1]

    def summary(self) -> dict:
        return {"itl_s": statistics.median(self.readings_s), "readings_s": self.readings_s,
                "path": self.path, "passes_s": self.passes_s, "copy_gb_s": self.copy_gb_s}


def runs_beside_floor(model_dir: str, floor: dict | None,
                      runs: list[Callable[[], T]]) -> tuple[list[T], dict | None]:
    """Each run's result, with the floor timed before the first run, between runs
    and after the last; None for the floor where the run measured none."""
    if not floor or "1" not in floor.get("passes", {}):
        return [run() for run in runs], None
    stream = StreamFloor(model_dir, floor)
    stream.time()
    results = []
    for run in runs:
        results.append(run())
        stream.time()
    return results, stream.summary()


def add_itl_to_floor(row: dict, beside: dict | None) -> None:
    """row's ITL p50 against the floor timed beside it, where there is one."""
    if beside:
        row["floor_beside"] = {**beside, "itl_ratio": row["itl_p50_s"] / beside["itl_s"]}
