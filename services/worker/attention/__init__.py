"""Attention backends behind one interface, all driven by AttentionMetadata."""
from __future__ import annotations

import importlib.util
import logging

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.cpu_paged import CpuPagedBackend

logger = logging.getLogger(__name__)

# Upstream flash-attn 2 reads a paged cache only in blocks of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


def make_attention_backend(name: str, device: torch.device, block_size: int):
    """The backend `name` picks (ModelConfig.attention_backend): "auto" is
    flash_attn on CUDA when flash-attn is installed and the block size suits it,
    cpu_paged otherwise."""
    if name == "auto":
        name = _auto_backend(device, block_size)
    if name == "cpu_paged":
        return CpuPagedBackend()
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError("the flash_attn backend runs on CUDA only; use cpu_paged")
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"flash-attn needs a KV block size that is a multiple of "
                             f"{FLASH_ATTN_BLOCK_MULTIPLE} (got {block_size}): pass "
                             f"--block-size {FLASH_ATTN_BLOCK_MULTIPLE}")
        from services.worker.attention.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, cpu_paged or flash_attn")


def _auto_backend(device: torch.device, block_size: int) -> str:
    usable = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    if usable and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        logger.warning("flash-attn needs --block-size %d; using cpu_paged",
                       FLASH_ATTN_BLOCK_MULTIPLE)
    return "flash_attn" if usable and not block_size % FLASH_ATTN_BLOCK_MULTIPLE else "cpu_paged"


__all__ = ["AttentionMetadata", "CpuPagedBackend", "make_attention_backend"]
