"""fp32 on Intel CPUs: MKL with the weight packed once (cblas_sgemm_pack,
torch's `_mkl_linear`, what inductor's freezing uses on the CPU), for the row
counts of decode steps; F.linear, which packs inside every call, for the rest.
The packed copy costs as much memory as the weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.cpu_matmul.onednn import PACK_BATCH_HINT

# Row counts where MKL's packed weights beat F.linear (bench/NOTES.md).
PACKED_ROWS = range(3, 97)


class MKLPackedWeights:
    """x W^T with W prepacked by MKL (fp32 models)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows not in PACKED_ROWS:
            return F.linear(x, self.weight)
        # _mkl_linear computes from the packed weight only when told that x has the
        # pack's batch size (otherwise it calls F.linear): MKL's packed B serves any
        # row count, as test_cpu_matmul checks, so pass x's own.
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, None, rows)


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
