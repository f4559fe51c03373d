"""The element-wise layers of the Llama family, and greedy sampling's argmax: C++ kernels on the CPU
(csrc/layers.cpp) when they could be built, and the torch references they are
tested against (also what runs on CUDA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_build import use_cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_cpu_ops(x):
        return torch.ops.llmserve.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in fp32, round, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) (both [T, hidden], contiguous)."""
    if use_cpu_ops(x):
        torch.ops.llmserve.fused_add_rms_norm(x, residual, weight, eps)
    else:
        fused_add_rms_norm_reference(x, residual, weight, eps)


def fused_add_rms_norm_reference(x, residual, weight, eps: float) -> None:
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor) -> None:
    """In place: q [T, H, D] and k [T, KV, D] rotated by each token's position;
    cos_sin [max_positions, 2, D / 2] fp32 (cos, then sin, of each frequency)."""
    if use_cpu_ops(q):
        torch.ops.llmserve.rotary_embedding(q, k, positions, cos_sin)
    else:
        rotary_embedding_reference(q, k, positions, cos_sin)


def rotary_embedding_reference(q, k, positions, cos_sin) -> None:
    """transformers' x * cos + rotate_half(x) * sin, cos and sin repeated over both halves."""
    cos, sin = (cos_sin[positions, i].repeat(1, 2)[:, None, :] for i in (0, 1))
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> SiLU(gate) * up, [T, I]."""
    if use_cpu_ops(gate_up):
        return torch.ops.llmserve.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] floats (fp32 or 16-bit) -> the first index of each row's
    maximum (int64)."""
    if logits.dim() == 2 and use_cpu_ops(logits):
        return torch.ops.llmserve.argmax_rows(logits)
    return logits.argmax(dim=-1)
