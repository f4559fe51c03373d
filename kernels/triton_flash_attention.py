"""FlashAttention over the paged KV cache, written in Triton: flash-attn 2's
flash_attn_varlen_func (paged form) for any block size and for fp32, bf16 and fp16.

Why our own kernel: upstream flash-attn publishes only an sdist (a long CUDA build), reads a
paged cache only in blocks of a multiple of 256 tokens, and has no fp32; the prebuilt
alternatives (flash-attn-4, flashinfer, sgl-kernel) each need more than the 64 MiB a GPU
machine of ours can receive in one transfer (tests/gpu/README.md). Triton ships with torch,
so this kernel runs wherever torch runs on CUDA, and in Triton's interpreter on the CPU,
which is how `make test` checks it against tests/references/flash_attn.py.

The algorithm is FlashAttention 2's: one program owns BLOCK_M query rows of one sequence and
one head, walks that sequence's keys BLOCK_N at a time through block_table, and keeps a
running max and sum (online softmax), so the scores never reach memory. The causal mask is
aligned to the bottom right, as flash-attn's is when a sequence has fewer queries than keys.
Every length is read from tensors on the device, so the launch is the same for any context
length: CUDA graphs can capture it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs tiles of at least 16 in each dimension.
BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _paged_flash_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, table_ptr,
    scale,
    q_stride_t, q_stride_h, q_stride_d,
    k_stride_b, k_stride_o, k_stride_h, k_stride_d,
    v_stride_b, v_stride_o, v_stride_h, v_stride_d,
    o_stride_t, o_stride_h, o_stride_d,
    table_stride_s, block_size, group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (query block, sequence, head): BLOCK_M rows of the output."""
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    len_q = tl.load(cu_q_ptr + seq + 1) - q_start
    len_k = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    first_row = tl.program_id(0) * BLOCK_M
    if first_row >= len_q:
        return
    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < len_q
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None].to(tl.int64) * q_stride_t
                + head * q_stride_h + dims[None, :] * q_stride_d,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    kv_head = head // group
    # Bottom-right causal alignment: row r is key position (len_k - len_q + r).
    offset = len_k - len_q
    end = tl.minimum(len_k, offset + first_row + BLOCK_M) if CAUSAL else len_k
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        # Paged: key position -> (block_table entry, offset in the block).
        block = tl.load(table_ptr + seq * table_stride_s + keys // block_size, mask=key_ok,
                        other=0).to(tl.int64)
        slot_k = block * k_stride_b + (keys % block_size) * k_stride_o + kv_head * k_stride_h
        slot_v = block * v_stride_b + (keys % block_size) * v_stride_o + kv_head * v_stride_h
        tile_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + slot_k[:, None] + dims[None, :] * k_stride_d, mask=tile_ok, other=0.0)
        v = tl.load(v_ptr + slot_v[:, None] + dims[None, :] * v_stride_d, mask=tile_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= offset + rows[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with no allowed key yet keeps m = -inf; subtract 0 there instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # A row that saw no key (flash-attn documents zeros) has l = 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None].to(tl.int64) * o_stride_t
             + head * o_stride_h + dims[None, :] * o_stride_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float | None = None, causal: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn 2's paged flash_attn_varlen_func: q [total_q, H, D]; k, v
    [num_blocks, block_size, KV, D]; block_table [B, max_blocks] int32. Returns [total_q, H, D].

    max_seqlen_k is accepted for the signature and not used: each program reads its
    sequence's length from cu_seqlens_k.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)
    _paged_flash_attention_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_table, scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        block_table.stride(0), k.shape[1], num_heads // k.shape[2],
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, CAUSAL=causal,
        # fp32 stays fp32: tensor cores would round its inputs to TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, block_table: torch.Tensor | None) -> None:
    if block_table is None:
        raise NotImplementedError("this kernel reads a paged KV cache only: pass block_table")
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                         ("block_table", block_table)):
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {tensor.dtype}")
    if k.dim() != 4 or k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k and v must both be [num_blocks, block_size, KV, {q.shape[-1]}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % k.shape[2]:
        raise ValueError("Number of heads in key/value must divide number of heads in query")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
