"""Decode attention over the paged KV cache on the CPU: a C++ kernel
(csrc/paged_decode_attention.cpp), built on first use with torch's cpp_extension,
and the pure-torch reference it is tested against.

The torch path has to gather every sequence's K/V out of the cache before calling
SDPA (a copy of the whole context each layer); the kernel reads the blocks in
place.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


@functools.cache
def load_kernel():
    """The compiled extension (cached by torch under ~/.cache/torch_extensions), or
    None when it cannot be built here (then callers use the torch path)."""
    try:
        import ninja  # the PyPI package: its binary is not on PATH inside a venv
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        from torch.utils.cpp_extension import load
        # -fopenmp compiles at::parallel_for's OpenMP path in; libgomp.so.1 then
        # resolves to the copy torch has already loaded, so there is one runtime.
        return load(name="llmserve_paged_decode_attention", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, headers or ninja: fall back, loudly
        logger.warning("CPU paged attention kernel unavailable (%s); using the torch path", e)
        return None


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D]; caches [num_blocks, block_size, KV, D]; block_table [B, max_blocks];
    seq_lens [B] -> [B, H, D]. Each query attends to its sequence's first seq_lens keys.
    The C++ kernel for fp32 when it could be built, the torch reference otherwise."""
    kernel = load_kernel() if query.dtype == torch.float32 else None
    if kernel is None:
        return paged_decode_attention_reference(query, key_cache, value_cache, block_table,
                                                seq_lens, scale)
    return kernel.paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens,
                                         scale)


def paged_decode_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                     scale: float) -> torch.Tensor:
    """The same in plain torch: gather each context, then masked SDPA."""
    keys, values = gather_blocks(key_cache, block_table), gather_blocks(value_cache, block_table)
    mask = torch.arange(keys.shape[2]) < seq_lens[:, None]
    return F.scaled_dot_product_attention(query.unsqueeze(2), keys, values,
                                          attn_mask=mask[:, None, None, :], scale=scale,
                                          enable_gqa=True).squeeze(2)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KV, D] -> [B, KV, max_blocks * block_size, D]."""
    b, n = block_table.shape
    blocks = cache[block_table]  # [B, n, block_size, KV, D]
    return blocks.reshape(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
