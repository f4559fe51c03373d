"""The metadata every attention backend reads, built once per step by the model runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each scheduled token's K/V goes and what each query attends to.

    A batch is B requests with their tokens laid end to end (varlen): request i
    owns query tokens query_start_loc[i]:query_start_loc[i+1], and after this step
    its cache holds seq_lens[i] tokens (context + new).
    """

    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    # The same two on the device, int32, as varlen kernels take them
    # (cu_seqlens_q and seqused_k in flash-attn's terms).
    query_start_loc_tensor: torch.Tensor  # [B + 1] int32
    seq_lens_tensor: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_size: int
    # For the CPU backend: requests with a single query token (decodes) go to the
    # decode kernel in one call, the others to the prefill kernel in another.
    # Built once per step, not once per layer.
    decode_token_indices: torch.Tensor  # [num_decodes] int64
    decode_seq_lens: torch.Tensor  # [num_decodes] int64
    decode_block_table: torch.Tensor  # [num_decodes, the blocks the longest uses] int64
    prefill_request_indices: list[int]

    @property
    def decodes_only(self) -> bool:
        """Every request has one query token (token i is request i's)."""
        return not self.prefill_request_indices
