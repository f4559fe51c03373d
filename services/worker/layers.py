"""Building blocks of the Llama-family models: norms, rotary embedding, activation.

The (tensor-parallel) linear layers are in linear.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the model dtype, as the HF reference does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_positions, computed once."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_frequencies(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # transformers scales cos and sin alike (yarn's attention factor), so the
        # attention logits grow by scaling squared.
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """cos and sin [T, 1, D] of each token's position, looked up once per step
        and shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KV, D]; rotates both by each token's position."""
    cos, sin = rope
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
