"""Attention backends behind one interface, all driven by AttentionMetadata."""
from __future__ import annotations

import importlib.util
import logging

import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

# Upstream flash-attn 2 reads a paged cache only in blocks of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_MULTIPLE = 256


def make_attention_backend(name: str, device: torch.device, block_size: int):
    """The backend `name` picks; "auto" is flash_attn on CUDA when flash-attn is
    installed, torch_sdpa otherwise."""
    if name == "auto":
        usable = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        if usable and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            logger.warning("flash-attn needs --block-size %d; using torch_sdpa",
                           FLASH_ATTN_BLOCK_MULTIPLE)
        name = ("flash_attn" if usable and not block_size % FLASH_ATTN_BLOCK_MULTIPLE
                else "torch_sdpa")
    if name == "torch_sdpa":
        return TorchSDPABackend()
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError("the flash_attn backend runs on CUDA only; use torch_sdpa")
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"flash-attn needs a KV block size that is a multiple of "
                             f"{FLASH_ATTN_BLOCK_MULTIPLE} (got {block_size}): pass "
                             f"--block-size {FLASH_ATTN_BLOCK_MULTIPLE}")
        from services.worker.attention.flash_attn import FlashAttentionBackend
        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch_sdpa or flash_attn")


__all__ = ["AttentionMetadata", "TorchSDPABackend", "make_attention_backend"]
