"""bf16 models on CPUs with AMX: our kernel (kernels/csrc/amx_linear.cpp) for
decode steps, on weights packed once into its tile layout; oneDNN for prefills,
which it wins from a few hundred rows. The AMX copy costs as much memory as the
weights."""
from __future__ import annotations

import torch

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_matmul.onednn import OneDNNWeights

# Up to this many rows our AMX kernel beats oneDNN (bench/NOTES.md).
AMX_MAX_ROWS = 128
# Up to this many rows our GEMV, reading the bf16 weights as they are, beats the AMX
# kernel, which multiplies whole tiles: a step of one row costs it as much as 32
# (bench/NOTES.md).
GEMV_OVER_AMX_ROWS = 4
# amx_bf16_linear's block: 32 output columns, K in steps of 32.
AMX_BLOCK = 32


class AMXWeights:
    """x W^T for bf16 models on AMX CPUs: our kernel for decode steps, oneDNN above."""

    def __init__(self, weight: torch.Tensor):
        self.onednn = OneDNNWeights(weight)
        self.packed = pack_amx_weight(weight.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= AMX_MAX_ROWS:
            return torch.ops.llmserve.amx_bf16_linear(x, self.packed)
        return self.onednn(x)


def pack_amx_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> amx_bf16_linear's layout [N/32, K/32, 1024]: for each block of
    32 output columns and each step of 32 along K, two weight tiles of 16 columns,
    each 16 rows of K pairs (the VNNI layout: W[n, 2r] and W[n, 2r + 1] side by
    side in row r), so a block's weights are one contiguous stream."""
    n, k = weight.shape
    block, half = AMX_BLOCK, AMX_BLOCK // 2  # a block is two tiles of 16 columns
    tiles = weight.reshape(n // block, 2, half, k // block, half, 2)  # [nb, tile, col, kb, pair, 2]
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(n // block, k // block,
                                                                 block * block)


def amx_available() -> bool:
    return cpu_ops_available() and torch.ops.llmserve.amx_bf16_available()


def fits_amx_blocks(weight: torch.Tensor) -> bool:
    return all(size % AMX_BLOCK == 0 for size in weight.shape)
