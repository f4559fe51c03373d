"""Random paged-attention inputs in flash_attn_varlen_func's form, shared by the kernel's
interpreted check on the CPU (tests/unit) and its compiled check on a GPU (tests/gpu)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata

# Each request: (tokens already in the cache, tokens scheduled this step).
BATCHES = {
    "mixed": [(20, 1), (0, 7), (18, 9), (33, 1), (0, 16), (16, 5)],
    "decodes": [(5, 1), (47, 1), (16, 1), (0, 1)],
    "prefills": [(0, 3), (0, 37)],
    "chunk_after_context": [(31, 40)],
}


@dataclass
class PagedCase:
    q: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_blocks] int32

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.cu_seqlens_k,
                self.max_seqlen_q, self.max_seqlen_k)


def random_paged_case(requests: list[tuple[int, int]], block_size: int, num_heads: int,
                      num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str | torch.device = "cpu", seed: int = 0) -> PagedCase:
    """A batch whose sequences own disjoint blocks in scrambled order, in a cache of random
    values: those past each sequence's end stand for stale data no kernel may read."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(done + new) // block_size) for done, new in requests]
    num_blocks = sum(needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(requests), max(needed), dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    query_lens = torch.tensor([new for _, new in requests])
    key_lens = torch.tensor([done + new for done, new in requests])

    def offsets(lens: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedCase(rand(int(query_lens.sum()), num_heads, head_dim), rand(*cache_shape),
                     rand(*cache_shape), offsets(query_lens).to(device),
                     offsets(key_lens).to(device), int(query_lens.max()), int(key_lens.max()),
                     table.to(device))


def build_metadata(requests: list[tuple[int, int]], block_ids: list[list[int]],
                   block_size: int) -> AttentionMetadata:
    """AttentionMetadata as ModelRunner.prepare_inputs builds it for these requests."""
    slots, seq_lens, query_start_loc = [], [], [0]
    for (num_computed, num_new), blocks in zip(requests, block_ids):
        pos = np.arange(num_computed, num_computed + num_new)
        slots.append(np.asarray(blocks)[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(num_computed + num_new)
        query_start_loc.append(query_start_loc[-1] + num_new)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_table = np.zeros((len(requests), max_blocks), dtype=np.int64)
    for i, blocks in enumerate(block_ids):
        block_table[i, :len(blocks[:max_blocks])] = blocks[:max_blocks]
    query_lens = np.diff(query_start_loc)
    decode_idx = np.flatnonzero(query_lens == 1)
    return AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens,
        query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=int(query_lens.max()), max_seq_len=max(seq_lens),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        block_size=block_size,
        decode_token_indices=torch.tensor([query_start_loc[i] for i in decode_idx],
                                          dtype=torch.int64),
        decode_seq_lens=torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.int64),
        decode_block_table=torch.from_numpy(block_table[decode_idx]),
        prefill_request_indices=np.flatnonzero(query_lens > 1).tolist())
