"""fp32 on Intel CPUs where our kernels lack AVX-512 (kernels/csrc/gemm.cpp needs
its registers): MKL with the weight packed once (cblas_sgemm_pack,
torch's `_mkl_linear`, what inductor's freezing uses on the CPU), for every row
count our GEMV leaves it (bench/NOTES.md). The packed copy costs as much memory
as the weights."""
from __future__ import annotations

import torch

from services.worker.cpu_matmul.gemv import GEMV_MAX_ROWS
from services.worker.cpu_matmul.onednn import PACK_BATCH_HINT

# Our GEMV takes one row in front of MKL's pack, which beats it from two rows on:
# a linear on our GEMV lets the C++ decode loop take one stream's steps, whose ITL
# was no faster with MKL's pack at one row too (Intel Xeon, bench/NOTES.md).
GEMV_OVER_MKL_ROWS = 1
# Our GEMV on a 16-bit copy of the weights (`--weight-dtype`) beat MKL's pack of
# the fp32 ones at every row count it takes (1-8, Intel Xeon): all of them.
SIXTEEN_BIT_GEMV_OVER_MKL_ROWS = GEMV_MAX_ROWS


class MKLPackedWeights:
    """x W^T with W prepacked by MKL (fp32 models)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # _mkl_linear computes from the packed weight only when told that x has the
        # pack's batch size (otherwise it calls F.linear): MKL's packed B serves any
        # row count, as test_cpu_matmul checks, so pass x's own. The C++ decode loop
        # (kernels/csrc/decode_layers.cpp) calls it the same way.
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, None,
                                         x.shape[0])


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
