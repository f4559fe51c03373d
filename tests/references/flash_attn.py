"""flash-attn 2's flash_attn_varlen_func in plain torch, written from its documented semantics.

A test reference, not a fast path: it loops over the sequences and does an explicit softmax.
It keeps the upstream signature so it can stand in for the real function, and checks what
the CUDA function checks (int32 cu_seqlens and block_table, H a multiple of KV), so a caller
that passes it also passes those checks. Options this server never uses (dropout, sliding
window, softcap, ALiBi, returning probabilities) raise NotImplementedError.
"""
from __future__ import annotations

import torch


def flash_attn_varlen_func_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [total_q, H, D]; k, v: [total_k, KV, D], or [num_blocks, block_size, KV, D] with a
    block_table [B, max_blocks]. Returns [total_q, H, D]."""
    _reject_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    _check_inputs(q, k, cu_seqlens_q, cu_seqlens_k, block_table)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        len_q, len_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            # The CUDA kernel sizes its grid from the maxima and would skip the excess silently.
            raise ValueError(f"sequence {i}: lengths q={len_q}, k={len_k} exceed "
                             f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k}")
        keys, values = _sequence_kv(k, v, cu_k[i], len_k, block_table, i)
        query = q[cu_q[i]:cu_q[i + 1]]
        out[cu_q[i]:cu_q[i + 1]] = _attend(query, keys, values, scale, causal).to(q.dtype)
    return out


def _sequence_kv(k: torch.Tensor, v: torch.Tensor, start: int, length: int,
                 block_table: torch.Tensor | None, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's keys and values, [length, KV, D] each."""
    if block_table is None:
        return k[start:start + length], v[start:start + length]
    # Paged: cu_seqlens_k only gives lengths; the tokens live in the blocks of row i.
    block_size = k.shape[1]
    num_blocks = -(-length // block_size)
    if num_blocks > block_table.shape[1]:
        raise ValueError(f"sequence {i}: {length} keys need {num_blocks} blocks, "
                         f"block_table has {block_table.shape[1]}")
    blocks = block_table[i, :num_blocks].long()
    flat_k = k[blocks].reshape(-1, k.shape[2], k.shape[3])
    flat_v = v[blocks].reshape(-1, v.shape[2], v.shape[3])
    return flat_k[:length], flat_v[:length]


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            causal: bool) -> torch.Tensor:
    """Softmax attention of one sequence in fp32: query [Lq, H, D], keys/values [Lk, KV, D]."""
    len_q, num_heads = query.shape[0], query.shape[1]
    len_k, num_kv_heads = keys.shape[0], keys.shape[1]
    # GQA: query heads g*r .. g*r + r - 1 share KV head g (r = H / KV).
    group = num_heads // num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if causal:
        # Bottom-right aligned: query t is the (len_k - len_q + t)-th key position.
        allowed = (torch.arange(len_k)[None, :]
                   <= torch.arange(len_q)[:, None] + (len_k - len_q))
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    probs = _softmax_zero_if_empty(scores)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _softmax_zero_if_empty(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row with every key masked out gives zeros (as documented)."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, block_table: torch.Tensor | None) -> None:
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {tensor.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both be [batch_size + 1]")
    if block_table is not None and block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table is not None and block_table.shape[0] != cu_seqlens_q.shape[0] - 1:
        raise ValueError("block_table must have one row per sequence")
    if q.shape[1] % k.shape[-2]:
        raise ValueError("Number of heads in key/value must divide number of heads in query")


def _reject_unsupported(dropout_p: float, window_size: tuple[int, int], softcap: float,
                        alibi_slopes: torch.Tensor | None, return_attn_probs: bool) -> None:
    if (dropout_p != 0.0 or tuple(window_size) != (-1, -1) or softcap != 0.0
            or alibi_slopes is not None or return_attn_probs):
        raise NotImplementedError("the reference supports only dropout_p=0, window_size=(-1, -1), "
                                  "softcap=0, alibi_slopes=None and return_attn_probs=False")
