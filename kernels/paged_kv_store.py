"""Writing the new tokens' K and V into the paged KV cache: a Triton kernel (its
torch reference is tests/references/paged_kv_store.py).

The cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V); token t goes to
flat slot slot_mapping[t] = block_id * block_size + offset, and a slot of -1 skips the token
(padding, as in vLLM).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one token's row (num_kv_heads * head_dim) a program moves per loop step; a
# power of two because tl.arange needs one. 1024 covers e.g. 8 heads x 128 in one step.
MAX_BLOCK = 1024


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    k_stride_t, k_stride_h, k_stride_d,
    v_stride_t, v_stride_h, v_stride_d,
    cache_stride_kv, cache_stride_block, cache_stride_offset, cache_stride_h, cache_stride_d,
    block_size,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per token: copies its ROW = heads * head_dim K and V elements to its slot."""
    token = tl.program_id(0).to(tl.int64)  # int64 so offsets into a large cache cannot overflow
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    dst = cache_ptr + block_id * cache_stride_block + offset * cache_stride_offset
    for start in range(0, ROW, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < ROW
        head = idx // HEAD_DIM
        dim = idx % HEAD_DIM
        key = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dim * k_stride_d, mask=mask)
        value = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dim * v_stride_d,
                        mask=mask)
        cache_off = head * cache_stride_h + dim * cache_stride_d
        tl.store(dst + cache_off, key, mask=mask)
        tl.store(dst + cache_stride_kv + cache_off, value, mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, block: int | None = None) -> None:
    """Writes k, v [T, KV, D] into kv_cache [2, num_blocks, block_size, KV, D] at slot_mapping [T].

    block: elements per loop step (a power of two); by default the row size rounded up to
    one, capped at MAX_BLOCK.
    """
    _check_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    block = block or min(triton.next_power_of_2(row), MAX_BLOCK)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        kv_cache.shape[2],
        HEAD_DIM=head_dim, ROW=row, BLOCK=block,
    )


def _check_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, KV, D], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {k.shape[1]}, "
                         f"{k.shape[2]}], got {tuple(kv_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:
        raise ValueError(f"k, v and kv_cache must share a dtype, got {k.dtype}, {v.dtype}, "
                         f"{kv_cache.dtype}")
