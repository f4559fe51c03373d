"""Attention backends behind one interface, all driven by AttentionMetadata."""
from __future__ import annotations

import importlib.util
import logging

import torch

from kernels.paged_attention import KERNEL_BLOCK_SIZES
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.cpu_paged import CpuPagedBackend

logger = logging.getLogger(__name__)

# Upstream flash-attn 2 reads a paged cache only in blocks of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


def make_attention_backend(name: str, device: torch.device, block_size: int,
                           dtype: torch.dtype):
    """The backend `name` picks (ModelConfig.attention_backend) for a KV cache of `dtype`."""
    if name == "auto":
        name = _auto_backend(device, block_size, dtype)
    if name == "cpu_paged":
        if device.type == "cpu" and block_size not in KERNEL_BLOCK_SIZES:
            # Served all the same, but a user who picked the size should know the cost.
            logger.warning("--block-size %d: the CPU attention kernels are built for blocks of "
                           "%s; these run the torch reference (several times slower at "
                           "decode)", block_size, ", ".join(map(str, KERNEL_BLOCK_SIZES)))
        return CpuPagedBackend()
    if device.type != "cuda":
        raise ValueError(f"the {name} backend runs on CUDA only; use cpu_paged")
    if name == "triton_attn":
        from services.worker.attention.flash_attn import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "flash_attn":
        _check_flash_attn_fits(block_size, dtype)
        from services.worker.attention.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of "
                     f"auto, cpu_paged, flash_attn, triton_attn")


def _check_flash_attn_fits(block_size: int, dtype: torch.dtype) -> None:
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        raise ValueError(f"flash-attn needs a KV block size that is a multiple of "
                         f"{FLASH_ATTN_BLOCK_MULTIPLE} (got {block_size}): pass --block-size "
                         f"{FLASH_ATTN_BLOCK_MULTIPLE}, or use --attention-backend triton_attn")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attn takes fp16 and bf16 only (got {dtype}): pass --dtype "
                         f"bfloat16, or use --attention-backend triton_attn")


def _auto_backend(device: torch.device, block_size: int, dtype: torch.dtype) -> str:
    """flash_attn on CUDA where it is installed and fits, else triton_attn; cpu_paged on the
    CPU."""
    if device.type != "cuda":
        return "cpu_paged"
    if importlib.util.find_spec("flash_attn") is None:
        return "triton_attn"
    try:
        _check_flash_attn_fits(block_size, dtype)
    except ValueError as e:
        logger.info("%s; using triton_attn", e)
        return "triton_attn"
    return "flash_attn"


__all__ = ["AttentionMetadata", "CpuPagedBackend", "make_attention_backend"]
