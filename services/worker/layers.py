"""Building blocks of the Llama-family models: norms and rotary embedding, over the
element-wise kernels of kernels/cpu_layers.py (C++ on the CPU, torch elsewhere).

The (tensor-parallel) linear layers are in linear.py, with the MLP's activation
(PackedColumnParallelLinear.silu_and_mul)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.cpu_layers import fused_add_rms_norm, rms_norm, rotary_embedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); or, given the residual stream, residual += x in place and
        (rms_norm(residual), residual) (vLLM's fused form: one pass, no new tensor)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


@dataclass
class Rope:
    """What every layer needs to rotate this step's q and k."""

    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, 2, head_dim / 2] fp32


class RotaryEmbedding(nn.Module):
    """cos and sin of every frequency at every position up to max_positions, once."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim)
        angles = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        # transformers scales cos and sin alike (yarn's attention factor), so the
        # attention logits grow by scaling squared.
        cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1) * scaling
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        return Rope(positions, self.cos_sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> None:
    """Rotates q [T, H, D] and k [T, KV, D] in place by each token's position."""
    rotary_embedding(q, k, rope.positions, rope.cos_sin)


# Rope types whose frequencies are fixed: cos/sin can be computed once for all
# positions. "dynamic" and "longrope" change them with the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scaling) for the config's rope,
    as transformers computes them."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    if 2 * inv_freq.numel() != head_dim:
        raise NotImplementedError(f"partial rotary embedding ({2 * inv_freq.numel()} of "
                                  f"{head_dim} dims) is not supported")
    return inv_freq, float(scaling)
