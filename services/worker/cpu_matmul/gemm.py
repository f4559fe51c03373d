"""Our GEMM kernel (kernels/csrc/gemm.cpp) on weights packed once into panels of
48 output columns (16 with AVX2): the fp32 path on CPUs with AVX-512, for every
step above the GEMV's row, in place of oneDNN's prepacked product (which it beat
on the model's shapes from 2 to 256 rows on an AMD EPYC, and about matched at
2,048) and of MKL's (which it beat from 2 to 512 rows on an Intel Xeon, and about
matched at 2,048), and on AMD CPUs with AVX2 only (an EPYC Zen 3: 1.2-1.8x
oneDNN's rate from 1 to 256 rows); a bf16 model's path on Intel CPUs without
AMX, on its bf16 weights with fp32 sums, where oneDNN's bf16 product ran at
0.61-0.76x its rate from 8 to 2,048 rows, and on any CPU whose kernels multiply
bf16 pairs (AVX512-BF16), where oneDNN's ran at 0.78-0.91x it from 8 to 256 rows
on an AMD EPYC Zen 5; and a 16-bit model's where oneDNN has no native product
for its dtype (bench/NOTES.md). On an MLP's gate_up weight it also applies the
activation inside the product (fused_silu_and_mul)."""
from __future__ import annotations

import torch

from kernels.cpu_build import cpu_ops_available, kernels_built_for_avx512
from services.worker.cpu_matmul.gemv import GEMV_MAX_ROWS, GemvForFewRows
from services.worker.host_memory import HugePageArena, huge_pages_available

# Up to this many rows our GEMV on the fp32 weights keeps up with the packed
# GEMM: on an AMD EPYC Zen 4 one row tied and at two the GEMM was 11% faster, on a
# Zen 5 one to six rows tied and the GEMM won at seven and eight (the rule off
# Intel); on an Intel Xeon, with the GEMV's prefetch, one and two rows tied and
# the GEMV won from three to eight, and offline batches of 4 ran 20% faster with
# it (bench/NOTES.md).
GEMV_OVER_PACKED_GEMM_ROWS = 1
GEMV_OVER_PACKED_GEMM_ROWS_ON_INTEL = GEMV_MAX_ROWS
# Up to this many rows our GEMV on a 16-bit copy of the weights (`--weight-dtype`)
# beats the packed GEMM on the fp32 ones: on an AMD EPYC Zen 4 at two rows it won
# in one process and lost in another, at three it tied or lost; where AVX-512 runs
# at full width (an Intel Xeon, an AMD EPYC Zen 5) it won at every row count it
# takes, and built for AVX2 (an AMD EPYC Zen 3) at the 6 rows of one pass, its
# cap there (bench/NOTES.md).
SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS = 1
SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS_FULL_WIDTH = GEMV_MAX_ROWS
# A bf16 model's own weights: our GEMV read them faster than the packed GEMM at
# every row count it takes (Intel Xeon, bench/NOTES.md).
BF16_GEMV_OVER_PACKED_GEMM_ROWS = GEMV_MAX_ROWS
# A bf16 model's own weights on pair panels (VDPBF16PS, bf16_dot_gemm_available):
# where AVX-512 runs at full width (an AMD EPYC Zen 5) our GEMV read them faster than
# the packed GEMM up to four rows (in 5 of 6 rounds at three and at four) and at 0.55x
# its rate at five (bench/NOTES.md). At half width two rows, as in front of oneDNN
# there (not measured against this GEMM).
BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH = 4
BF16_GEMV_OVER_DOT_GEMM_ROWS = 2
# An fp16 model's own weights where oneDNN has no native fp16: on an AMD EPYC Zen 5
# our GEMV read them faster than the packed GEMM up to 4 rows and lost at 8
# (bench/NOTES.md).
FP16_GEMV_OVER_PACKED_GEMM_ROWS = 4


class PackedGemmWeights:
    """x W^T for x of W's dtype (fp32, bf16 or fp16), through our GEMM kernel on W
    packed in panels."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        self.packed = torch.ops.llmserve.pack_gemm_weight(weight.detach())
        # gemm_silu_and_mul takes a gate_up weight whose halves are whole panels.
        self.fuses_silu = self.out_features % (2 * torch.ops.llmserve.gemm_panel_columns()) == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmserve.gemm(x, self.packed, self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate/up weight's x W^T in the product's own pass, where
        each half is whole panels; None where it is not."""
        if not self.fuses_silu:
            return None
        return torch.ops.llmserve.gemm_silu_and_mul(x, self.packed, self.out_features)


def fused_silu_and_mul(strategy, x: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul(strategy(x)) in one kernel where x's rows go to our packed GEMM and
    it fuses the two: gate_up's product, twice the output, then never goes through
    memory (bench/NOTES.md). None elsewhere (the GEMV's rows, other strategies)."""
    while isinstance(strategy, GemvForFewRows) and x.shape[0] > strategy.max_rows:
        strategy = strategy.many
    return strategy.silu_and_mul(x) if isinstance(strategy, PackedGemmWeights) else None


def packed_gemm_available() -> bool:
    """Whether our GEMM kernel is built here (kernels/csrc/gemm.cpp): tiles of 8 rows x
    48 columns with AVX-512, of 6 x 16 with AVX2's 16 registers."""
    return cpu_ops_available()


def packed_gemm_tiles_avx512() -> bool:
    """Whether its tiles are AVX-512's, where every rule but the AVX2 ones was measured."""
    return kernels_built_for_avx512()


def bf16_dot_gemm_available() -> bool:
    """Whether the kernel multiplies bf16 by bf16 here (built with AVX512-BF16): bf16
    weights are then packed in pairs of K for it."""
    return packed_gemm_available() and bool(torch.ops.llmserve.gemm_bf16_dot_available())


def pack_arena(weights: list[torch.Tensor]) -> HugePageArena | None:
    """One HugePageArena with room for our GEMM's pack of each [N, K] weight (its
    rows padded to whole panels, at most fp32's 4 bytes an element: the caller
    releases the room left), or None where huge pages or the kernel are not
    available. Its pages fault in from the back while the packs fill it from the
    front."""
    if not weights or not packed_gemm_available() or not huge_pages_available():
        return None
    panel = torch.ops.llmserve.gemm_panel_columns()
    return HugePageArena(HugePageArena.bytes_for_sizes(
        -(-w.shape[0] // panel) * panel * w.shape[1] * 4 for w in weights), populate=True)


def pack_onto(arena: HugePageArena | None, strategy) -> None:
    """Moves a PackedGemmWeights' pack into `arena`, as the worker does with the
    parameters: the panels stream with fewer TLB misses (bench/NOTES.md). Other
    strategies, or no arena, stay as they are."""
    if arena is not None and isinstance(strategy, PackedGemmWeights):
        strategy.packed = arena.copy_of(strategy.packed)
