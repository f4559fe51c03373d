"""torch SDPA attention over the paged KV cache (the CPU backend)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_paged_attention import gather_blocks, load_kernel, paged_decode_attention
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
        if not meta.prefill_request_indices:  # decodes only: token i is request i's query
            return self._decode(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        if meta.decode_request_indices.numel():
            out[meta.decode_token_indices] = self._decode(q, kv_cache, meta, scale)
        for i in meta.prefill_request_indices:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q, k, v, kv_cache, meta, i, scale)
        return out

    def __init__(self):
        load_kernel()  # build the CPU decode kernel at start-up, not on the first request

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """All single-token queries at once, reading their contexts in place."""
        seq_lens = meta.decode_seq_lens
        num_blocks = -(-int(seq_lens.max()) // meta.block_size)
        block_table = meta.block_table[meta.decode_request_indices, :num_blocks]
        return paged_decode_attention(q[meta.decode_token_indices], kv_cache[0], kv_cache[1],
                                      block_table, seq_lens, scale)

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
        keys, values = (gather_blocks(kv_cache[j], block_table)[0, :, :seq_len] for j in (0, 1))
        # Query t sits at position seq_len - query_len + t and sees keys up to it.
        query_pos = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True).transpose(0, 1)

