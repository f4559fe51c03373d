"""FlashAttention over the paged KV cache (the CUDA backends: flash_attn and triton_attn).

Each step writes the new K/V with our Triton kernel, then makes one flash_attn_varlen_func
call for the whole mixed batch (decodes, prefills, prefill chunks after cached context):
flash-attn reads the paged cache through block_table, and its causal mask, aligned to the
bottom right when a sequence has fewer queries than keys, is what a chunk after cached
context needs.

Upstream flash-attn 2 accepts a paged cache only with a block size that is a multiple of 256
("Paged KV cache block size must be divisible by 256"); vLLM's fork relaxes that, upstream
does not. It also takes only fp16/bf16.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.paged_kv_store import store_kv_cache
from services.worker.attention.metadata import AttentionMetadata

# flash_attn_varlen_func's signature (flash-attn 2.x), or a stand-in with the same one.
VarlenFn = Callable[..., torch.Tensor]


def load_flash_attn_varlen() -> VarlenFn:
    """flash_attn.flash_attn_varlen_func, or an ImportError that says how to get it."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise ImportError(
            "the flash_attn attention backend needs flash-attn 2 (a CUDA build): "
            "pip install -e '.[cuda]' on a machine with an NVIDIA GPU, or use the cpu_paged "
            "backend") from exc
    return flash_attn_varlen_func


class FlashAttentionBackend:
    """Attention with flash-attn's varlen kernel, reading K/V from the paged cache."""

    name = "flash_attn"
    # Tensors only, no host reads: CUDA graphs can capture its decode steps.
    graph_safe = True

    def __init__(self, varlen_fn: VarlenFn | None = None):
        self._varlen_fn = load_flash_attn_varlen() if varlen_fn is None else varlen_fn

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """flash-attn's paged layout: [2, num_blocks, block_size, KV, D]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def bind_cache(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """What forward() gets as kv_cache: the cache itself."""
        return kv_cache

    @staticmethod
    def logical_kv(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as [num_blocks, block_size, KV, D] (already so)."""
        return kv_cache[0], kv_cache[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] for the new tokens; returns [T, H, D]."""
        store_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return self._varlen_fn(
            q, kv_cache[0], kv_cache[1],
            meta.query_start_loc_tensor, cumulative_seq_lens(meta.seq_lens_tensor),
            meta.max_query_len, meta.max_seq_len,
            softmax_scale=scale, causal=True,
            # flash-attn takes int32 only; the runner keeps int64 for torch indexing.
            block_table=meta.block_table.to(torch.int32),
        )


class TritonAttentionBackend(FlashAttentionBackend):
    """The same steps with our Triton FlashAttention kernel
    (kernels/triton_flash_attention.py): any block size, fp32 as well as 16 bits."""

    name = "triton_attn"

    def __init__(self):
        from kernels.triton_flash_attention import flash_attn_varlen_func
        super().__init__(flash_attn_varlen_func)


def cumulative_seq_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] int32 offsets starting at 0 (cu_seqlens_k)."""
    # With block_table, flash-attn reads only the differences (each sequence's key count);
    # the keys themselves come from the blocks.
    return F.pad(torch.cumsum(seq_lens, dim=0, dtype=torch.int32), (1, 0))
