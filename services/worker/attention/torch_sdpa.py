"""The CPU backend: decode attention by the C++ paged kernel, prefills by torch's
scaled_dot_product_attention, over the CPU layout of the paged KV cache
(kernels/cpu_paged_attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_build import cpu_ops_available
from kernels.cpu_paged_attention import (gather_blocks, kv_cache_shape, logical_key_cache,
                                         logical_value_cache, paged_decode_attention,
                                         split_kv_cache, write_kv_cache)
from services.worker.attention.metadata import AttentionMetadata


class TorchSDPABackend:
    name = "torch_sdpa"

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
        out = torch.empty_like(q)
        if meta.decode_seq_lens.numel():
            out[meta.decode_token_indices] = paged_decode_attention(
                q[meta.decode_token_indices], key_cache, value_cache, meta.decode_block_table,
                meta.decode_seq_lens, scale)
        for i in meta.prefill_request_indices:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q, k, v, key_cache, value_cache, meta, i, scale)
        return out

    @staticmethod
    def _prefill(q, k, v, key_cache, value_cache, meta: AttentionMetadata, i: int,
                 scale: float) -> torch.Tensor:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        query_len, seq_len = end - start, meta.seq_lens[i]
        query = q[start:end].transpose(0, 1)  # [H, Q, D]
        if seq_len == query_len:  # nothing cached before: attend to the new tokens only
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            return _sdpa(query, keys, values, scale, is_causal=True)
        num_blocks = -(-seq_len // meta.block_size)
        block_table = meta.block_table[i:i + 1, :num_blocks]
        keys, values = (gather_blocks(cache, block_table)[0, :, :seq_len].to(q.dtype) for cache in
                        (logical_key_cache(key_cache), logical_value_cache(value_cache)))
        # Query t sits at position seq_len - query_len + t and sees keys up to it.
        query_pos = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        return _sdpa(query, keys, values, scale, attn_mask=mask)


def _sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
          **mask) -> torch.Tensor:
    """query [H, Q, D], keys/values [KV, S, D] -> [Q, H, D]. torch's fused CPU
    kernel takes 4-D inputs (3-D ones fall back to its math path, at about half
    the speed) and serves grouped K/V heads itself with enable_gqa: the same
    result as repeating them, 10-25% faster at a 128-token prefill (measured,
    fp32 and bf16)."""
    out = F.scaled_dot_product_attention(query[None], keys[None], values[None], scale=scale,
                                         enable_gqa=True, **mask)
    return out[0].transpose(0, 1)
