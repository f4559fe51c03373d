"""kernels.paged_kv_store.store_kv_cache in plain torch."""
from __future__ import annotations

import torch


def store_kv_cache_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, KV, D] into kv_cache [2, num_blocks, block_size, KV, D] at
    flat slots block_id * block_size + offset; slot -1 skips the token."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[2]
    block_ids, offsets = slots // block_size, slots % block_size
    kv_cache[0, block_ids, offsets] = k[keep]
    kv_cache[1, block_ids, offsets] = v[keep]
