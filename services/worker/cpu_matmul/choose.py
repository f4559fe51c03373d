"""Which strategy each linear layer gets, chosen once per model from its dtype
and this CPU (the measurements behind each rule: bench/NOTES.md):

- bf16 models on CPUs with AMX: our GEMV for up to four rows, our AMX kernel for
  the rest of the decodes, oneDNN above; on
  CPUs with AVX512-BF16 (without AMX): our GEMM multiplying bf16 pairs, our GEMV
  for up to four rows (two where AVX-512 runs at half width); on Intel CPUs without
  either, with AVX-512: our GEMM on the bf16 weights, our GEMV for few rows;
- 16-bit models on CPUs with native bf16/fp16: oneDNN prepacked, our GEMV for
  one or two rows (bf16 up to four where AVX-512 runs at full width); elsewhere:
  our GEMM on the 16-bit weights where it is built, our GEMV for few rows;
- fp32 models with `--weight-dtype bfloat16/float16`: our GEMV on a 16-bit copy
  of the weights for up to weight_dtype_max_rows() rows, the fp32 path above;
- with kernels built without AVX-512, our GEMV for at most 6 rows (gemv_rows);
- fp32 on CPUs with AVX-512, and on AMD CPUs with AVX2: our GEMM on weights we
  pack; on Intel CPUs without AVX-512: MKL prepacked; where our kernels are not
  built: oneDNN prepacked (MKL runs generic code paths off Intel); our GEMV in
  front of each for one row (two before oneDNN, up to eight before our GEMM on
  Intel: fp32_gemv_rows);
- otherwise F.linear.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_info import avx512_full_width, cpu_is_intel
from services.worker.cpu_matmul.amx import (AMX_MAX_ROWS, GEMV_OVER_AMX_ROWS, AMXWeights,
                                            amx_available, fits_amx_blocks)
from services.worker.cpu_matmul.gemm import (BF16_GEMV_OVER_DOT_GEMM_ROWS,
                                             BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH,
                                             BF16_GEMV_OVER_PACKED_GEMM_ROWS,
                                             FP16_GEMV_OVER_PACKED_GEMM_ROWS,
                                             GEMV_OVER_PACKED_GEMM_ROWS,
                                             GEMV_OVER_PACKED_GEMM_ROWS_ON_INTEL,
                                             SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS,
                                             SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS_FULL_WIDTH,
                                             PackedGemmWeights, bf16_dot_gemm_available,
                                             packed_gemm_available, packed_gemm_tiles_avx512,
                                             pack_arena, pack_onto)
from services.worker.cpu_matmul.gemv import (BF16_GEMV_OVER_ONEDNN_ROWS_FULL_WIDTH,
                                             GEMV_OVER_FP32_ROWS, GEMV_OVER_ONEDNN_ROWS,
                                             GemvForFewRows, gemv_rows, with_gemv)
from services.worker.cpu_matmul.mkl import (GEMV_OVER_MKL_ROWS, SIXTEEN_BIT_GEMV_OVER_MKL_ROWS,
                                            MKLPackedWeights, mkl_packing_available)
from services.worker.cpu_matmul.onednn import OneDNNWeights, onednn_native
from services.worker.cpu_matmul.strategy import FLinear, MatmulStrategy

Make = Callable[[torch.Tensor], MatmulStrategy]

# fp32_path()'s names of the packed paths, which prepare_cpu_linears also logs.
PACKED_GEMM_PATH = "our packed GEMM"
MKL_PACKED_PATH = "MKL prepacked"
ONEDNN_PACKED_PATH = "oneDNN prepacked"
# A bf16 model's on AMX CPUs.
AMX_PATH = f"AMX for <= {AMX_MAX_ROWS} rows, oneDNN prepacked above"


def prepare_cpu_linears(layers: Iterable[nn.Module], dtype: torch.dtype,
                        weight_dtype: torch.dtype | None) -> str:
    """Sets `cpu_weights` on every layer (those of linear.linear_layers) where a
    faster CPU path exists; returns the name of the path chosen."""
    make, path = _choose(dtype, weight_dtype)
    if make is None:
        return path
    layers = list(layers)
    # Each pack moves onto huge pages as soon as it is made, so that the next pack
    # takes the heap memory it leaves: made all before any moved, every pack was
    # alive at once, and each weight's pages were first touched twice
    # (bench/NOTES.md).
    arena = pack_arena([layer.weight for layer in layers])
    for layer in layers:
        layer.cpu_weights = make(layer.weight)
        pack_onto(arena, _many(layer.cpu_weights))
    if arena is not None:  # sized for fp32 packs, and populated: 16-bit ones leave room
        arena.release_room()
    # The name says what was built: with_gemv decides per layer.
    on_gemv = [isinstance(layer.cpu_weights, GemvForFewRows) for layer in layers]
    if path in (ONEDNN_PACKED_PATH, MKL_PACKED_PATH, PACKED_GEMM_PATH, AMX_PATH) and any(on_gemv):
        path += f", our GEMV for <= {layers[on_gemv.index(True)].cpu_weights.max_rows} rows"
        if not all(on_gemv):
            path += " where the input width is a multiple of 16"
    return path


def _choose(dtype: torch.dtype, weight_dtype: torch.dtype | None) -> tuple[Make | None, str]:
    if dtype == torch.bfloat16 and onednn_native(dtype) and amx_available():
        return _amx_or_onednn, AMX_PATH
    # On Intel only with AVX-512 tiles: the AVX2 ones were never measured against
    # oneDNN's bf16 product.
    if dtype == torch.bfloat16 and (bf16_dot_gemm_available() or (
            cpu_is_intel() and packed_gemm_tiles_avx512())):
        return sixteen_bit_model_weights, PACKED_GEMM_PATH
    if dtype in (torch.bfloat16, torch.float16) and onednn_native(dtype):
        return onednn_weights, ONEDNN_PACKED_PATH
    if dtype in (torch.bfloat16, torch.float16) and packed_gemm_available():
        return sixteen_bit_model_weights, PACKED_GEMM_PATH
    if dtype == torch.float32 and weight_dtype is not None and cpu_ops_available():
        name = str(weight_dtype).removeprefix("torch.")
        return (lambda weight: sixteen_bit_weights(weight, weight_dtype),
                f"{name} weights for <= {weight_dtype_max_rows()} rows")
    if dtype == torch.float32 and fp32_path() != "F.linear":
        return fp32_weights, fp32_path()
    return None, "F.linear"


def _many(strategy: MatmulStrategy) -> MatmulStrategy:
    """The strategy a GemvForFewRows hands its larger steps to (itself otherwise),
    through the nesting of the 16-bit weights mode."""
    while isinstance(strategy, GemvForFewRows):
        strategy = strategy.many
    return strategy


def _amx_or_onednn(weight: torch.Tensor) -> MatmulStrategy:
    """A bf16 weight on an AMX CPU: our GEMV for few rows, then the AMX kernel where
    the weight fills its blocks, oneDNN's packed product where it does not."""
    if not fits_amx_blocks(weight):
        return onednn_weights(weight)
    return with_gemv(weight, gemv_rows(GEMV_OVER_AMX_ROWS), AMXWeights(weight))


def onednn_weights(weight: torch.Tensor) -> MatmulStrategy:
    """oneDNN-prepacked W, read by our GEMV for few rows (onednn_gemv_rows)."""
    return with_gemv(weight, onednn_gemv_rows(weight.dtype), OneDNNWeights(weight))


def onednn_gemv_rows(dtype: torch.dtype) -> int:
    """How many rows our GEMV takes in front of oneDNN's packed weights of `dtype`."""
    if dtype == torch.bfloat16 and avx512_full_width():
        return gemv_rows(BF16_GEMV_OVER_ONEDNN_ROWS_FULL_WIDTH)
    return gemv_rows(GEMV_OVER_ONEDNN_ROWS)


def sixteen_bit_model_weights(weight: torch.Tensor) -> MatmulStrategy:
    """A 16-bit model's W, packed in its own dtype for our GEMM (fp32 sums), read by our
    GEMV for few rows, as many as it beat the GEMM at in that dtype: bf16 models on CPUs
    with AVX512-BF16 (pairs of K) or on Intel without AMX, fp16 ones where oneDNN has no
    native fp16 (there torch's fp16 product ran 7-9x slower than our GEMM from 16 rows
    on: bench/NOTES.md)."""
    rows = (bf16_packed_gemv_rows() if weight.dtype == torch.bfloat16
            else gemv_rows(FP16_GEMV_OVER_PACKED_GEMM_ROWS))
    return with_gemv(weight, rows, PackedGemmWeights(weight))


def bf16_packed_gemv_rows() -> int:
    """How many rows our GEMV takes in front of our packed GEMM on a bf16 model's
    weights: pair panels where the kernels multiply bf16 pairs, else widened ones."""
    if not bf16_dot_gemm_available():
        return gemv_rows(BF16_GEMV_OVER_PACKED_GEMM_ROWS)
    return gemv_rows(BF16_GEMV_OVER_DOT_GEMM_ROWS_FULL_WIDTH if avx512_full_width()
                     else BF16_GEMV_OVER_DOT_GEMM_ROWS)


def weight_dtype_max_rows() -> int:
    """The most rows a step may have for `--weight-dtype` to act on it on this CPU:
    as many as its GEMV beats this CPU's fp32 path at (bench/NOTES.md)."""
    every_row = avx512_full_width() or not packed_gemm_tiles_avx512()
    packed_gemm = (SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS_FULL_WIDTH if every_row
                   else SIXTEEN_BIT_GEMV_OVER_PACKED_GEMM_ROWS)
    return _rows_before_fp32_path(packed_gemm, SIXTEEN_BIT_GEMV_OVER_MKL_ROWS,
                                  GEMV_OVER_FP32_ROWS)


def sixteen_bit_weights(weight: torch.Tensor, weight_dtype: torch.dtype) -> MatmulStrategy:
    """x W^T for fp32 activations, reading a 16-bit copy of W for few rows."""
    return with_gemv(weight.to(weight_dtype), weight_dtype_max_rows(), fp32_weights(weight))


def fp32_weights(weight: torch.Tensor) -> MatmulStrategy:
    """The fastest x W^T for an fp32 weight on this CPU."""
    path = fp32_path()
    if path == MKL_PACKED_PATH:
        return with_gemv(weight, fp32_gemv_rows(), MKLPackedWeights(weight))
    if path == PACKED_GEMM_PATH:
        return with_gemv(weight, fp32_gemv_rows(), PackedGemmWeights(weight))
    if path == ONEDNN_PACKED_PATH:
        return onednn_weights(weight)
    return FLinear(weight)


def fp32_gemv_rows() -> int:
    """How many rows our GEMV takes in front of this CPU's fp32 path (bench/NOTES.md)."""
    packed_gemm = (GEMV_OVER_PACKED_GEMM_ROWS_ON_INTEL if cpu_is_intel()
                   else GEMV_OVER_PACKED_GEMM_ROWS)
    return _rows_before_fp32_path(packed_gemm, GEMV_OVER_MKL_ROWS, GEMV_OVER_ONEDNN_ROWS)


def _rows_before_fp32_path(packed_gemm: int, mkl: int, other: int) -> int:
    """The rows a GEMV takes before this CPU's fp32 path, as measured against it: our
    packed GEMM, MKL's pack, or the rest; capped by gemv_rows."""
    path = fp32_path()
    if path == PACKED_GEMM_PATH:
        return gemv_rows(packed_gemm)
    return gemv_rows(mkl if path == MKL_PACKED_PATH else other)


def fp32_path() -> str:
    """Which of fp32_weights' paths this CPU takes: our GEMM's AVX2 tiles were measured
    against oneDNN (on an AMD EPYC), not MKL, so Intel CPUs without AVX-512 keep MKL's."""
    if packed_gemm_available() and (packed_gemm_tiles_avx512() or not cpu_is_intel()):
        return PACKED_GEMM_PATH
    if cpu_is_intel() and mkl_packing_available():
        return MKL_PACKED_PATH
    if not cpu_is_intel() and torch.backends.mkldnn.is_available():
        return ONEDNN_PACKED_PATH
    return "F.linear"
