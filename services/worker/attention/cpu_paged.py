"""cpu_paged: attention by our C++ paged kernels (decodes, and causal prefills)
over the CPU layout of the paged KV cache (kernels/paged_attention.py); their
torch references (gather, then torch's scaled_dot_product_attention) on other
devices and shapes. Once called torch_sdpa, a name still accepted."""
from __future__ import annotations

import torch

from kernels.cpu_build import cpu_ops_available
from kernels.paged_attention import (kv_cache_shape, logical_key_cache, logical_value_cache,
                                         paged_decode_attention, paged_prefill_attention,
                                         split_kv_cache, write_kv_cache)
from services.worker.attention.metadata import AttentionMetadata


class CpuPagedBackend:
    name = "cpu_paged"
    graph_safe = False

    def __init__(self):
        cpu_ops_available()  # build the CPU kernels at start-up, not on the first request

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def logical_kv(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as [num_blocks, block_size, KV, D] views."""
        key_cache, value_cache = split_kv_cache(kv_cache, block_size)
        return logical_key_cache(key_cache), logical_value_cache(value_cache)

    @staticmethod
    def bind_cache(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What forward() gets as kv_cache: the key and value views, made once."""
        return split_kv_cache(kv_cache, block_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] for the new tokens; returns [T, H, D]."""
        key_cache, value_cache = kv_cache
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.decodes_only:
            return paged_decode_attention(q, key_cache, value_cache, meta.decode_block_table,
                                          meta.decode_seq_lens, scale)
        # Prefills read their own K/V back from the cache, written just above. q
        # stays a view into the qkv projection (the kernel takes its token stride).
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        if meta.decode_seq_lens.numel():
            out[meta.decode_token_indices] = paged_decode_attention(
                q[meta.decode_token_indices], key_cache, value_cache, meta.decode_block_table,
                meta.decode_seq_lens, scale)
        paged_prefill_attention(q, key_cache, value_cache, meta.block_table,
                                meta.seq_lens_tensor, meta.query_start_loc_tensor, scale, out)
        return out
