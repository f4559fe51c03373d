"""torch SDPA attention over the paged KV cache (the CPU backend)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchSDPABackend:
    """Attention with torch's scaled_dot_product_attention, reading K/V from the paged cache."""

    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] for the new tokens; returns [T, H, D]."""
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode_request_indices.numel():
            out[meta.decode_token_indices] = self._decode(q, kv_cache, meta, scale)
        for i in meta.prefill_request_indices:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q, k, v, kv_cache, meta, i, scale)
        return out

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        seq_lens = meta.decode_seq_lens
        num_blocks = -(-int(seq_lens.max()) // meta.block_size)
        block_table = meta.block_table[meta.decode_request_indices, :num_blocks]
        keys, values = (_gather(kv_cache[j], block_table) for j in (0, 1))  # [B, KV, L, D]
        mask = torch.arange(keys.shape[2]) < seq_lens[:, None]  # [B, L]
        query = q[meta.decode_token_indices].unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, k, v, kv_cache, meta: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        query_len, seq_len = end - start, meta.seq_lens[i]
        query = q[start:end].transpose(0, 1)  # [H, Q, D]
        if seq_len == query_len:  # nothing cached before: attend to the new tokens only
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                  enable_gqa=True).transpose(0, 1)
        num_blocks = -(-seq_len // meta.block_size)
        block_table = meta.block_table[i:i + 1, :num_blocks]
        keys, values = (_gather(kv_cache[j], block_table)[0, :, :seq_len] for j in (0, 1))
        # Query t sits at position seq_len - query_len + t and sees keys up to it.
        query_pos = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True).transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, KV, D] -> [B, KV, max_blocks * block_size, D]."""
    b, n = block_table.shape
    blocks = cache[block_table]  # [B, n, block_size, KV, D]
    return blocks.reshape(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
