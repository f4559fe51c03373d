"""How the linear layers multiply on the CPU, chosen once after the weights load.

- 16-bit models on CPUs with native bf16/fp16 (AMX, AVX512-BF16): oneDNN with
  weights reordered once into its blocked layout, as vLLM-CPU does. Measured here
  (AMX): +40-60% at 64-2048 rows, and one row streams the weights at ~20 GB/s
  where F.linear reaches ~10.
- Wherever oneDNN serves decode steps (all but AMX and MKL below), steps of one
  or two rows (a single stream) go through our GEMV kernel on the weights as
  loaded. All of SmolLM2's weights at one row, AMD EPYC with AVX512-BF16:
  oneDNN 15.8 ms bf16 and 25.2 ms fp32, the GEMV 12.3 and 18.5 (a bare sum over
  them: 10.0 and 16.9); at two rows 14.6 / 32.9 against 14.1 / 21.6; from four
  rows oneDNN is ahead.
- bf16 models on CPUs with AMX: steps of at most AMX_MAX_ROWS rows (decodes) go
  through our AMX kernel (kernels/csrc/amx_linear.cpp), with the weights packed
  once into its tile layout; prefills keep oneDNN, which is faster from a few
  hundred rows. The AMX copy costs as much memory as the weights.
- fp32 models with 16-bit weights (`--weight-dtype bfloat16`, for CPUs without
  bf16 units): the weights are also kept in bf16; steps of at most
  GEMV_MAX_ROWS rows (decodes of a few sequences, bound by reading the weights)
  read those through the GEMV kernel with fp32 activations and sums; bigger steps
  (compute-bound) use the fp32 weights.
- fp32 on Intel CPUs: MKL with weights packed once (cblas_sgemm_pack, torch's
  `_mkl_linear`, what inductor's freezing uses on the CPU). Against F.linear,
  which packs the weight inside every call: 1.2x at 64-96 rows, 1.4-1.9x at 4-32
  rows (measured here, AMX Xeon, 30 distinct weights per shape): the rows of
  decode steps. At one or two rows the two are equal, and from 128 rows
  (prefills) neither wins consistently (0.98-1.2x, and a 128-token prefill's TTFT
  was 9-12% slower in two A/B rounds); F.linear keeps those. oneDNN's fp32 path
  did not beat F.linear there. The packed copy costs as much memory as the weights.
- fp32 on other CPUs: oneDNN with weights reordered once, for every row count.
  MKL runs its generic code paths on them: on an AMD EPYC with AVX-512, all of
  SmolLM2's weights took 45 ms at one row through F.linear and 25 through oneDNN,
  160 against 91 ms at 64 rows, 504 against 381 at 256 (GFLOP/s 6 -> 11,
  107 -> 189, 137 -> 181); MKL's pack was no faster than F.linear there.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_info import cpu_is_intel

logger = logging.getLogger(__name__)

# Up to this many rows, a step reads weights faster than it multiplies them.
GEMV_MAX_ROWS = 8
# Up to this many rows our GEMV beats oneDNN's prepacked weights (docstring).
GEMV_OVER_ONEDNN_ROWS = 2
# Row counts where MKL's packed fp32 weights beat F.linear (module docstring).
PACKED_ROWS = range(3, 97)
# oneDNN lays packed weights out for a batch size; any batch size then works.
_PACK_BATCH_HINT = 64
# Up to this many rows our AMX kernel beats oneDNN (all model weights, one row
# set per step, alternating in one process: 1.1-1.7x at 32-96 rows, equal at 1-16
# and 128; 0.3x at 2048, where x no longer stays in cache).
AMX_MAX_ROWS = 128
# amx_bf16_linear's block: 32 output columns, K in steps of 32.
_AMX_BLOCK = 32


class OneDNNWeights:
    """x W^T with W prepacked by oneDNN (16-bit models; fp32 ones off Intel CPUs)."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


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
    block, half = _AMX_BLOCK, _AMX_BLOCK // 2  # a block is two tiles of 16 columns
    tiles = weight.reshape(n // block, 2, half, k // block, half, 2)  # [nb, tile, col, kb, pair, 2]
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(n // block, k // block,
                                                                 block * block)


class MKLPackedWeights:
    """x W^T with W prepacked by MKL (fp32 models)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, _PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows not in PACKED_ROWS:
            return F.linear(x, self.weight)
        # _mkl_linear computes from the packed weight only when told that x has the
        # pack's batch size (otherwise it calls F.linear): MKL's packed B serves any
        # row count, as test_cpu_linear checks, so pass x's own.
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, None, rows)


class GemvForFewRows:
    """x W^T through our GEMV kernel on `gemv_weight` for up to `max_rows` rows
    (decodes of a few sequences, bound by reading the weights), `many` above."""

    def __init__(self, gemv_weight: torch.Tensor, max_rows: int, many):
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


def with_gemv(gemv_weight: torch.Tensor, max_rows: int, many):
    """`many` with our GEMV for up to max_rows rows, where the kernel takes the shape."""
    if gemv_takes(gemv_weight.shape[1]):
        return GemvForFewRows(gemv_weight, max_rows, many)
    return many


def sixteen_bit_weights(weight: torch.Tensor, weight_dtype: torch.dtype):
    """x W^T for fp32 activations, reading a 16-bit copy of W for few rows."""
    return with_gemv(weight.to(weight_dtype), GEMV_MAX_ROWS, fp32_weights(weight))


def onednn_weights(weight: torch.Tensor):
    """oneDNN-prepacked W, read by our GEMV at up to GEMV_OVER_ONEDNN_ROWS rows."""
    return with_gemv(weight, GEMV_OVER_ONEDNN_ROWS, OneDNNWeights(weight))


def fp32_weights(weight: torch.Tensor):
    """The fastest x W^T for an fp32 weight on this CPU (module docstring)."""
    path = fp32_path()
    if path == "MKL prepacked":
        return MKLPackedWeights(weight)
    if path == "oneDNN prepacked":
        return onednn_weights(weight)
    detached = weight.detach()
    return lambda x: F.linear(x, detached)


def fp32_path() -> str:
    """Which of fp32_weights' paths this CPU takes."""
    if cpu_is_intel() and mkl_packing_available():
        return "MKL prepacked"
    if not cpu_is_intel() and torch.backends.mkldnn.is_available():
        return "oneDNN prepacked"
    return "F.linear"


def matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x W^T for one of our linear layers (no bias), as prepare_cpu_linears set it up."""
    weights = getattr(layer, "cpu_weights", None)
    if weights is None:
        return F.linear(x, layer.weight)
    y = weights(x.reshape(-1, x.shape[-1]))
    return y.view(*x.shape[:-1], y.shape[-1])


def prepare_cpu_linears(model: nn.Module, dtype: torch.dtype,
                        weight_dtype: torch.dtype | None) -> str:
    """Sets `cpu_weights` on every linear layer that has a faster CPU path; returns
    the name of the path chosen."""
    if dtype == torch.bfloat16 and onednn_native(dtype) and _amx_available():
        make = lambda weight: (AMXWeights(weight) if _fits_amx_blocks(weight)  # noqa: E731
                               else OneDNNWeights(weight))
        path = f"AMX for <= {AMX_MAX_ROWS} rows, oneDNN prepacked above"
    elif dtype in (torch.bfloat16, torch.float16) and onednn_native(dtype):
        make, path = onednn_weights, "oneDNN prepacked"
    elif dtype == torch.float32 and weight_dtype is not None and cpu_ops_available():
        make = lambda weight: sixteen_bit_weights(weight, weight_dtype)  # noqa: E731
        path = f"{str(weight_dtype).removeprefix('torch.')} weights for <= {GEMV_MAX_ROWS} rows"
    elif dtype == torch.float32 and fp32_path() != "F.linear":
        make, path = fp32_weights, fp32_path()
    else:
        return "F.linear"
    layers = linear_layers(model)
    for layer in layers:
        layer.cpu_weights = make(layer.weight)
    # The name says what was built: with_gemv decides per layer.
    on_gemv = [isinstance(layer.cpu_weights, GemvForFewRows) for layer in layers]
    if path == "oneDNN prepacked" and any(on_gemv):
        path += f", our GEMV for <= {GEMV_OVER_ONEDNN_ROWS} rows"
        if not all(on_gemv):
            path += " where the input width is a multiple of 16"
    return path


def linear_layers(model: nn.Module) -> list[nn.Module]:
    from services.worker.linear import ParallelLMHead
    return [m for m in model.modules() if isinstance(m, (nn.Linear, ParallelLMHead))]


def onednn_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` natively in oneDNN (otherwise it emulates it,
    slower than fp32)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _amx_available() -> bool:
    return cpu_ops_available() and torch.ops.llmserve.amx_bf16_available()


def _fits_amx_blocks(weight: torch.Tensor) -> bool:
    return all(size % _AMX_BLOCK == 0 for size in weight.shape)


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
