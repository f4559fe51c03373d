"""oneDNN with the weight reordered once into its blocked layout, as vLLM-CPU
does: 16-bit models on CPUs that compute them natively; fp32 ones off Intel."""
from __future__ import annotations

import torch

# oneDNN lays packed weights out for a batch size; any batch size then works.
PACK_BATCH_HINT = 64


class OneDNNWeights:
    """x W^T with W prepacked by oneDNN."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def onednn_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` natively in oneDNN (otherwise it emulates
    it, slower than fp32)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()
