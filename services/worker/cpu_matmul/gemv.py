"""Our GEMV kernel (kernels/csrc/gemv.cpp) for steps of a few rows, which are
bound by reading the weights: it reads them front to back once, in fp32, bf16
or fp16, with fp32 sums. Another strategy serves the larger steps."""
from __future__ import annotations

import torch

from kernels.cpu_build import cpu_ops_available, kernels_built_for_avx512
from services.worker.cpu_matmul.strategy import MatmulStrategy

# Up to this many rows, a step reads weights faster than it multiplies them.
GEMV_MAX_ROWS = 8
# Up to this many rows our GEMV beats oneDNN's prepacked weights (bench/NOTES.md).
GEMV_OVER_ONEDNN_ROWS = 2
# On a bf16 model's own weights where AVX-512 runs at full width, off Intel (where
# our GEMM serves them): on an AMD EPYC Zen 5 our GEMV beat oneDNN's bf16 product
# up to 4 rows in two runs, to 6 in one of them, and lost at 8 (bench/NOTES.md).
BF16_GEMV_OVER_ONEDNN_ROWS_FULL_WIDTH = 4
# Up to this many rows our GEMV over a 16-bit copy of the weights beats oneDNN's
# prepacked fp32 path over fp32 ones; from 6 rows on it tied or lost (an AVX-512 AMD
# EPYC, bench/NOTES.md), so the `--weight-dtype` mode acts up to here over oneDNN.
GEMV_OVER_FP32_ROWS = 5
# Built without AVX-512, one pass of our GEMV over the weights serves up to 6 rows
# (their sums in AVX2's 16 registers, kernels/csrc/gemv.cpp); more read the weights
# twice, and at 8 rows 16-bit weights lost to MKL's pack of the fp32 ones built for
# AVX2 (36.5 against 34.7 ms a pass; at 6 rows 27.9 won; bench/NOTES.md).
GEMV_ROWS_WITHOUT_AVX512 = 6


def gemv_rows(limit: int) -> int:
    """How many rows our GEMV takes here where `limit` is what it takes when the
    kernels are built for AVX-512 (by default for the host's own vector width)."""
    return limit if kernels_built_for_avx512() else min(limit, GEMV_ROWS_WITHOUT_AVX512)


class GemvForFewRows:
    """x W^T through our GEMV kernel on `gemv_weight` for up to `max_rows` rows,
    `many` above."""

    def __init__(self, gemv_weight: torch.Tensor, max_rows: int, many: MatmulStrategy):
        self.gemv_weight = gemv_weight.detach()
        self.max_rows = max_rows
        self.many = many

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return torch.ops.llmserve.gemv(x, self.gemv_weight)
        return self.many(x)


def gemv_takes(k: int) -> bool:
    """Whether our GEMV kernel is built here and takes inputs k wide (whole vectors
    of 16; it takes up to GEMV_MAX_ROWS rows)."""
    return cpu_ops_available() and k % 16 == 0


def with_gemv(gemv_weight: torch.Tensor, max_rows: int, many: MatmulStrategy) -> MatmulStrategy:
    """`many` with our GEMV for up to max_rows rows, where the kernel takes the shape."""
    if gemv_takes(gemv_weight.shape[1]):
        return GemvForFewRows(gemv_weight, max_rows, many)
    return many
