"""The CPU backend's paged KV cache: its layout, writing new tokens' K/V, and
decode attention over it. C++ kernels (csrc/paged_attention.cpp) when they could
be built, and the pure-torch references they are tested against.

Layout per layer: one tensor [2, num_blocks, kv_heads, block_size * head_dim]:
- keys as [num_blocks, kv_heads, head_dim, block_size]: transposed per block, so
  a block's scores against a query are vertical SIMD multiply-adds;
- values as [num_blocks, kv_heads, block_size, head_dim].
`logical_key_cache` / `logical_value_cache` view both as [num_blocks, block_size,
kv_heads, head_dim], the layout the rest of the code reasons in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_build import use_cpu_ops

# What the C++ decode kernel is compiled for (csrc/paged_attention.cpp); other
# shapes take the torch reference.
KERNEL_HEAD_DIMS = (32, 64, 96, 128)
KERNEL_BLOCK_SIZES = (16, 32, 128)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size * head_dim)


def split_kv_cache(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache [N, KV, D, bs], value_cache [N, KV, bs, D]) views of a layer's cache."""
    n, kv_heads, size = kv_cache.shape[1:]
    head_dim = size // block_size
    return (kv_cache[0].view(n, kv_heads, head_dim, block_size),
            kv_cache[1].view(n, kv_heads, block_size, head_dim))


def logical_key_cache(key_cache: torch.Tensor) -> torch.Tensor:
    """[N, KV, D, bs] -> a [N, bs, KV, D] view."""
    return key_cache.permute(0, 3, 1, 2)


def logical_value_cache(value_cache: torch.Tensor) -> torch.Tensor:
    """[N, KV, bs, D] -> a [N, bs, KV, D] view."""
    return value_cache.permute(0, 2, 1, 3)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, KV, D] go to slot slot_mapping[t] = block * block_size + offset,
    rounded to the cache's dtype when it is a 16-bit cache under an fp32 model."""
    if use_cpu_ops(k, key_cache):
        torch.ops.llmserve.write_kv_cache(k, v, key_cache, value_cache, slot_mapping)
    else:
        write_kv_cache_reference(k, v, key_cache, value_cache, slot_mapping)


def write_kv_cache_reference(k, v, key_cache, value_cache, slot_mapping) -> None:
    block_size = key_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    logical_key_cache(key_cache)[blocks, offsets] = k.to(key_cache.dtype)
    logical_value_cache(value_cache)[blocks, offsets] = v.to(value_cache.dtype)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D]; block_table [B, max_blocks]; seq_lens [B] -> [B, H, D].
    Each query attends to the first seq_lens keys of its sequence. The cache may be
    16-bit under an fp32 query; the output has the query's dtype."""
    if (query.shape[-1] in KERNEL_HEAD_DIMS and key_cache.shape[-1] in KERNEL_BLOCK_SIZES
            and use_cpu_ops(query, key_cache)):
        return torch.ops.llmserve.paged_decode_attention(query, key_cache, value_cache,
                                                         block_table, seq_lens, scale)
    return paged_decode_attention_reference(query, key_cache, value_cache, block_table,
                                            seq_lens, scale)


def paged_decode_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                     scale: float) -> torch.Tensor:
    """The same in plain torch: gather each context, then masked SDPA."""
    keys = gather_blocks(logical_key_cache(key_cache), block_table).to(query.dtype)
    values = gather_blocks(logical_value_cache(value_cache), block_table).to(query.dtype)
    mask = torch.arange(keys.shape[2]) < seq_lens[:, None]
    return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                          attn_mask=mask[:, None, None, :], scale=scale,
                                          enable_gqa=True).squeeze(2)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A logical cache [num_blocks, block_size, KV, D] -> [B, KV, max_blocks * block_size, D]."""
    b, n = block_table.shape
    blocks = cache[block_table]  # [B, n, block_size, KV, D]
    return blocks.reshape(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
