"""The CPU backend's paged KV cache: its layout, writing new tokens' K/V, and
attention over it (decodes, and causal prefills). C++ kernels
(csrc/paged_attention.cpp, paged_prefill.cpp) when they could be built, and the pure-torch
references they are tested against. The references ship because they also
serve: they run where the kernels do not (CUDA tensors without flash-attn,
head dims and block sizes the kernels are not compiled for, no compiler).

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

# What the C++ attention kernels are compiled for (the dispatch in
# csrc/paged_attention.h); other shapes take the torch references.
KERNEL_HEAD_DIMS = (32, 64, 96, 128)
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)


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


def _kernel_takes(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return (query.shape[-1] in KERNEL_HEAD_DIMS and key_cache.shape[-1] in KERNEL_BLOCK_SIZES
            and use_cpu_ops(query, key_cache))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D]; block_table [B, max_blocks]; seq_lens [B] -> [B, H, D].
    Each query attends to the first seq_lens keys of its sequence. The cache may be
    16-bit under an fp32 query; the output has the query's dtype."""
    if _kernel_takes(query, key_cache):
        return torch.ops.llmserve.paged_decode_attention(query, key_cache, value_cache,
                                                         block_table, seq_lens, scale)
    return paged_decode_attention_reference(query, key_cache, value_cache, block_table,
                                            seq_lens, scale)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, out: torch.Tensor) -> None:
    """Writes into out [T, H, D] the attention of every sequence with more than one
    query token (its rows; the others' are left alone). Sequence i owns query
    rows query_start_loc[i]:query_start_loc[i+1], the last of its seq_lens[i]
    tokens, whose K/V the cache already holds; each attends causally to its
    sequence's keys up to its own position."""
    # The query may be a view into the qkv projection (its tokens' rows wider than
    # their heads), as the model passes it: the kernel reads it in place.
    heads_contiguous = query.stride(2) == 1 and query.stride(1) == query.shape[2]
    if _kernel_takes(query, key_cache) and heads_contiguous and out.is_contiguous():
        torch.ops.llmserve.paged_prefill_attention(query, key_cache, value_cache, block_table,
                                                   seq_lens, query_start_loc, scale, out)
    else:
        paged_prefill_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                          query_start_loc, scale, out)


def paged_prefill_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                      query_start_loc, scale: float, out) -> None:
    """The same in plain torch: per sequence, gather its context, then masked SDPA."""
    block_size = key_cache.shape[-1]
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        if end - start < 2:
            continue
        table = block_table[i:i + 1, :-(-seq_len // block_size)]
        keys, values = (gather_blocks(cache, table)[0, :, :seq_len].to(query.dtype) for cache in
                        (logical_key_cache(key_cache), logical_value_cache(value_cache)))
        # Query t sits at position seq_len - (end - start) + t and sees keys up to it.
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        # 4-D inputs: torch's fused CPU kernel takes those (3-D ones fall back to its
        # math path, at about half the speed), and serves grouped K/V heads itself.
        out[start:end] = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], keys[None], values[None], scale=scale,
            attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


def paged_decode_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                     scale: float) -> torch.Tensor:
    """The same in plain torch: gather each context, then masked SDPA."""
    keys = gather_blocks(logical_key_cache(key_cache), block_table).to(query.dtype)
    values = gather_blocks(logical_value_cache(value_cache), block_table).to(query.dtype)
    mask = torch.arange(keys.shape[2], device=keys.device) < seq_lens[:, None]
    return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                          attn_mask=mask[:, None, None, :], scale=scale,
                                          enable_gqa=True).squeeze(2)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A logical cache [num_blocks, block_size, KV, D] -> [B, KV, max_blocks * block_size, D]."""
    b, n = block_table.shape
    blocks = cache[block_table]  # [B, n, block_size, KV, D]
    return blocks.reshape(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
