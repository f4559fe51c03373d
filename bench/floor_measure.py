"""The timing half of the machine floor (bench/floor.py): a pass over the model's
linear layers at M rows, with distinct weights per layer, through each way torch
multiplies by a weight here, and a large copy."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

MIN_PASS_SECONDS = 0.3  # time passes until this much has run (and at least MIN_RUNS)
MIN_RUNS = 3


def make_weights(linears: list[tuple[str, int, int, int]],
                 dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """One weight per layer, in layer order: a pass streams the whole model from
    memory as a real forward does (one weight reused would sit in the cache). On
    huge pages, as the worker keeps its weights, where this OS has them."""
    from services.worker.host_memory import HugePageArena, huge_pages_available

    shapes = [(name, (n, k)) for i in range(max(count for *_, count in linears))
              for name, k, n, count in linears if i < count]
    if not huge_pages_available():
        return [(name, torch.randn(shape).to(dtype)) for name, shape in shapes]
    arena = HugePageArena(HugePageArena.bytes_for(
        [torch.empty(shape, dtype=dtype, device="meta") for _, shape in shapes]))
    return [(name, arena.copy_of(torch.randn(shape).to(dtype))) for name, shape in shapes]


# One layer of a pass: its shape's name, its input width, and x -> x W^T.
Layer = tuple[str, int, Callable[[torch.Tensor], torch.Tensor]]


# The GEMV kernel's path; it takes at most GEMV_MAX_ROWS rows.
GEMV_PATH = "llmserve GEMV"
PACKED_GEMM_PATH = "llmserve packed GEMM"
AMX_PATH = "llmserve AMX kernel"


def gemm_paths(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], Callable]]:
    """Each way we know to compute x W^T on this CPU, as a maker of x -> x W^T for
    a weight: F.linear, W packed once by oneDNN (what vLLM-CPU runs), by MKL
    (inductor's freezing; read at every row count, as the engine runs it above our
    GEMV's one row) or by us for our GEMM kernel (AVX-512; fp32 sums in any
    dtype), for a few rows our GEMV kernel reading W as it is, and for bf16 on AMX
    CPUs our AMX kernel. Which is fastest depends on the CPU: MKL runs generic code
    on non-Intel ones."""
    from kernels.cpu_build import cpu_ops_available
    from services.worker.cpu_matmul.amx import amx_available
    from services.worker.cpu_matmul.gemm import PackedGemmWeights, packed_gemm_available
    from services.worker.cpu_matmul.mkl import MKLPackedWeights, mkl_packing_available
    from services.worker.cpu_matmul.onednn import OneDNNWeights, onednn_native

    paths = {"F.linear": lambda w: lambda x: F.linear(x, w)}
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or onednn_native(dtype)):
        paths["oneDNN prepacked"] = OneDNNWeights
    if dtype == torch.float32 and mkl_packing_available():
        paths["MKL prepacked"] = MKLPackedWeights
    if packed_gemm_available():
        paths[PACKED_GEMM_PATH] = PackedGemmWeights
    if cpu_ops_available():
        paths[GEMV_PATH] = lambda w: lambda x: torch.ops.llmserve.gemv(x, w)
    if dtype == torch.bfloat16 and amx_available():
        paths[AMX_PATH] = amx_kernel
    return paths


def amx_kernel(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x W^T through our AMX kernel at any row count (the engine stops at AMX_MAX_ROWS,
    where oneDNN took over when it was measured); oneDNN's packed product for a
    weight that does not fill the kernel's blocks, as the engine runs it."""
    from services.worker.cpu_matmul.amx import fits_amx_blocks, pack_amx_weight
    from services.worker.cpu_matmul.onednn import OneDNNWeights

    if not fits_amx_blocks(weight):
        return OneDNNWeights(weight)
    packed = pack_amx_weight(weight)
    return lambda x: torch.ops.llmserve.amx_bf16_linear(x, packed)


def prepare(weights: list[tuple[str, torch.Tensor]]) -> dict[str, list[Layer]]:
    """The layers of a pass through each of gemm_paths, weights packed once."""
    paths = gemm_paths(weights[0][1].dtype)
    with torch.inference_mode():
        return {path: [(name, w.shape[1], make(w)) for name, w in weights]
                for path, make in paths.items()}


def _one_pass(layers: list[Layer], inputs: dict[int, torch.Tensor],
              shapes: dict[str, float]) -> float:
    """Every linear once; adds each call's seconds to its shape's total."""
    total = 0.0
    for name, k, multiply in layers:
        start = time.perf_counter()
        multiply(inputs[k])
        seconds = time.perf_counter() - start
        shapes[name] = shapes.get(name, 0.0) + seconds
        total += seconds
    return total


def time_pass(paths: dict[str, list[Layer]], dtype: torch.dtype, m: int) -> dict:
    """The best pass at m rows, over several passes through each path: its seconds,
    each shape's share, and its path (with every path's best seconds)."""
    from services.worker.cpu_matmul.gemv import GEMV_MAX_ROWS, gemv_takes

    inputs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k, _ in paths["F.linear"]}}
    results = {path: best_pass(layers, inputs) for path, layers in paths.items()
               if path != GEMV_PATH or (m <= GEMV_MAX_ROWS and all(map(gemv_takes, inputs)))}
    path = min(results, key=lambda p: results[p]["seconds"])
    return {"m": m, **results[path], "path": path,
            "path_seconds": {p: r["seconds"] for p, r in results.items()}}


def best_pass(layers: list[Layer], inputs: dict[int, torch.Tensor]) -> dict:
    """The fastest of several passes through layers: its seconds, each shape's share
    and the number of passes run."""
    best: tuple[float, dict[str, float]] | None = None
    spent, runs = 0.0, 0
    with torch.inference_mode():
        # Warm-up: one call per distinct shape sets up its kernel (the weights were
        # first touched when made), far cheaper than a whole pass at large M.
        for name, k, multiply in {name: (name, k, f) for name, k, f in layers}.values():
            multiply(inputs[k])
        while runs < MIN_RUNS or spent < MIN_PASS_SECONDS:
            shapes: dict[str, float] = {}
            seconds = _one_pass(layers, inputs, shapes)
            spent, runs = spent + seconds, runs + 1
            if best is None or seconds < best[0]:
                best = (seconds, shapes)
    return {"seconds": best[0], "shapes_s": best[1], "runs": runs}


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
