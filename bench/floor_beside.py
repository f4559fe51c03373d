"""The floor timed again beside the runs held against it.

The floor section times the machine once, at the start of a run. On the 2-core
VMs this bench runs on, memory reads swing 24-40 GB/s from one minute to the
next (bench/NOTES.md), so a figure measured ten minutes later was held against
another minute's machine: in one run the in-process ITL came in at 0.89x the
one-stream floor and the served one at 1.35x. Here the floor section's fastest
path at each row count a run needs, and the copy, are timed again just before,
between and just after the runs, and each figure is also given against the
median of the floors those readings make (floor.workload_floor, as the floor
section's)."""
from __future__ import annotations

import statistics
from typing import Callable, TypeVar

import torch

from bench import floor as F
from bench import floor_measure as fm

T = TypeVar("T")


class FloorBeside:
    """The floor section's fastest path at each of its row counts up to
    `most_rows`, weights made once; read() times those passes and the copy again."""

    def __init__(self, model_dir: str, floor: dict, most_rows: int):
        dtype = getattr(torch, floor["dtype"])
        self.shape = F.ModelShape.from_model_dir(model_dir)
        self.ms = sorted(int(m) for m in floor["passes"] if int(m) <= most_rows)
        self._paths = {m: floor["passes"][str(m)]["path"] for m in self.ms}
        makers = fm.gemm_paths(dtype)
        weights = fm.make_weights(self.shape.linears(), dtype)
        with torch.inference_mode():
            self._layers = {path: [(name, w.shape[1], makers[path](w)) for name, w in weights]
                            for path in set(self._paths.values())}
        widths = {w.shape[1] for _, w in weights}
        self._inputs = {m: {k: torch.randn(m, k).to(dtype) for k in widths} for m in self.ms}
        self._bytes_per_param = floor["bytes_per_param"]

    @classmethod
    def of(cls, model_dir: str, floor: dict | None, most_rows: int) -> FloorBeside | None:
        """None where the run measured no floor (--skip-floor)."""
        return cls(model_dir, floor, most_rows) if floor and "1" in floor["passes"] else None

    def read(self, ms: list[int] | None = None) -> F.Measured:
        """The machine now, as floor.measured_from reads the floor section: GFLOP/s
        of a pass at each of ms rows (all by default) and the weight-streaming rate,
        the faster of the copy and the one-row pass."""
        seconds = {str(m): fm.best_pass(self._layers[self._paths[m]], self._inputs[m])["seconds"]
                   for m in ms or self.ms}
        return F.measured_from({**F.pass_rates(self.shape, seconds, self._bytes_per_param),
                                "copy_gb_s": fm.copy_bandwidth(F.COPY_BYTES),
                                "bytes_per_param": self._bytes_per_param})

    def runs(self, runs: list[Callable[[], T]],
             ms: list[int] | None = None) -> tuple[list[T], list[F.Measured]]:
        """Each run's result, and the readings taken before the first run, between
        runs and after the last."""
        readings, results = [self.read(ms)], []
        for run in runs:
            results.append(run())
            readings.append(self.read(ms))
        return results, readings


def runs_beside(floors: FloorBeside | None, runs: list[Callable[[], T]],
                ms: list[int] | None = None) -> tuple[list[T], list[F.Measured] | None]:
    """FloorBeside.runs, or the runs alone (no readings) where there is no floor."""
    if floors is None:
        return [run() for run in runs], None
    return floors.runs(runs, ms)


def add_itl_to_floor(row: dict, floors: FloorBeside | None,
                     readings: list[F.Measured] | None) -> None:
    """row's ITL p50 against the one-stream floor of the readings beside it."""
    if not readings:
        return
    per_token = [F.decode_seconds(floors.shape, m, 1, 1) for m in readings]
    itl = statistics.median(per_token)
    row["floor_beside"] = {"itl_s": itl, "readings_s": per_token,
                           "itl_ratio": row["itl_p50_s"] / itl}


def add_share_of_floor(row: dict, floors: FloorBeside | None,
                       readings: list[F.Measured] | None, prompt_len: int,
                       output_len: int) -> None:
    """row's output tok/s (a batch of row["requests"]) as a share of the floor of
    the readings beside it, and of that floor with KV reads."""
    if not readings:
        return
    n = row["requests"]
    each = [F.workload_floor(floors.shape, m, n, prompt_len, output_len, n) for m in readings]
    tok_s = statistics.median(f["output_tok_s"] for f in each)
    with_kv = statistics.median(f["with_kv_reads"]["output_tok_s"] for f in each)
    row["floor_beside"] = {"output_tok_s": tok_s, "with_kv_reads_tok_s": with_kv,
                           "readings_tok_s": [f["output_tok_s"] for f in each],
                           "share": row["output_tok_s"] / tok_s,
                           "share_with_kv_reads": row["output_tok_s"] / with_kv}
