"""The timing half of the machine floor (bench/floor.py): a pass over the model's
linear layers at M rows, with distinct weights per layer, and a large copy."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

MIN_PASS_SECONDS = 0.3  # time passes until this much has run (and at least MIN_RUNS)
MIN_RUNS = 3


def make_weights(linears: list[tuple[str, int, int, int]],
                 dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """One weight per layer, in layer order: a pass streams the whole model from
    memory as a real forward does (one weight reused would sit in the cache)."""
    weights = []
    for i in range(max(count for *_, count in linears)):
        for name, k, n, count in linears:
            if i < count:
                weights.append((name, torch.randn(n, k).to(dtype)))
    return weights


def _one_pass(weights: list[tuple[str, torch.Tensor]], inputs: dict[int, torch.Tensor],
              shapes: dict[str, float]) -> float:
    """Every linear once; adds each call's seconds to its shape's total."""
    total = 0.0
    for name, w in weights:
        start = time.perf_counter()
        F.linear(inputs[w.shape[1]], w)
        seconds = time.perf_counter() - start
        shapes[name] = shapes.get(name, 0.0) + seconds
        total += seconds
    return total


def time_pass(weights: list[tuple[str, torch.Tensor]], m: int) -> dict:
    """The best of several passes at m rows: its seconds and each shape's share."""
    dtype = weights[0][1].dtype
    inputs = {k: torch.randn(m, k).to(dtype) for k in {w.shape[1] for _, w in weights}}
    best: tuple[float, dict[str, float]] | None = None
    spent, runs = 0.0, 0
    with torch.inference_mode():
        # Warm-up: one call per distinct shape sets up its kernel (the weights were
        # first touched when made), far cheaper than a whole pass at large M.
        for w in {tuple(w.shape): w for _, w in weights}.values():
            F.linear(inputs[w.shape[1]], w)
        while runs < MIN_RUNS or spent < MIN_PASS_SECONDS:
            shapes: dict[str, float] = {}
            seconds = _one_pass(weights, inputs, shapes)
            spent, runs = spent + seconds, runs + 1
            if best is None or seconds < best[0]:
                best = (seconds, shapes)
    return {"m": m, "seconds": best[0], "shapes_s": best[1], "runs": runs}


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """GB/s of a large tensor copy, counting bytes read plus bytes written (STREAM's
    convention: the memory traffic moved), best of `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9
