"""Keeps the host memory a step frees in the process, for the next step.

A prefill step of 2,048 tokens allocates tens of MB per layer (the MLP's gate and
up rows alone are 25 MB in fp32) and frees them before the next layer. glibc's
malloc hands blocks that large to mmap, or trims them off the heap when freed,
so every step faults its activations in again, page by page, and the kernel
zeroes each page: about 127,000 faults and a quarter of a second of system time
per such step on two cores (bench/NOTES.md). vLLM-CPU avoids this by preloading
tcmalloc; glibc's own two settings do it without a library to install.

What they cannot stop: protobuf's Python runtime (upb) calls malloc_trim(0)
every 10,000 frees of its own, which hands every free heap page back whatever
the thresholds say; a gRPC worker's steps still fault in part (bench/NOTES.md).

The weights, which a decode step streams whole, and the KV cache, whose blocks
its attention reads scattered, live on transparent huge pages (HugePageArena):
on 4 KB pages the walk through the page tables (two levels of them in a virtual
machine) slows the reads; malloc and torch ask for huge pages only where the
kernel applies them to every mapping, or torch's THP_MEM_ALLOC_ENABLE is set
before its first large allocation.
"""
from __future__ import annotations

import ctypes
import math
import mmap
from typing import Iterable

import torch
from torch import nn

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's cap on the mmap threshold on 64-bit builds (HEAP_MAX_SIZE / 2): blocks
# above it are still mmapped (a step's largest is a few MB below, at 2,048 tokens).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top is returned to the kernel only above this much
# (mallopt's largest): what a step frees stays for the next one.
TRIM_THRESHOLD = (1 << 31) - 1


def keep_freed_host_memory() -> bool:
    """Sets glibc's thresholds in this process; False where malloc is not glibc's
    (musl, macOS), which has no mallopt or other rules."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


HUGE_PAGE = 2 << 20
# Each tensor starts on a cache line: vector loads of a row never straddle two.
TENSOR_ALIGNMENT = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


class HugePageArena:
    """One private anonymous mapping, advised for transparent huge pages and
    aligned to them, handed out front to back as tensors. The mapping
    lives as long as any tensor cut from it."""

    def __init__(self, nbytes: int):
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(region, dtype=torch.uint8)
        self._offset = (-self._bytes.data_ptr()) % HUGE_PAGE
        self._end = self._offset + nbytes

    @staticmethod
    def bytes_for(tensors: list[torch.Tensor]) -> int:
        return HugePageArena.bytes_for_sizes(t.nbytes for t in tensors)

    @staticmethod
    def bytes_for_sizes(sizes: Iterable[int]) -> int:
        return sum(_aligned(nbytes) for nbytes in sizes)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of this shape and dtype, as the mapping holds it (zeros
        where nothing was written yet)."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = self._offset
        self._offset += _aligned(nbytes)
        if self._offset > self._end:
            raise ValueError(f"the arena's {self._end - start} bytes left cannot hold {nbytes}")
        return self._bytes[start:start + nbytes].view(dtype).view(shape)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.take(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def huge_pages_available() -> bool:
    """Whether this OS takes the advice (Linux; a kernel built without THP refuses it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        HugePageArena(0)
    except OSError:
        return False
    return True


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor on a huge-page mapping of its own, or torch.zeros where huge
    pages are not available. For the KV cache: a decode step reads each sequence's
    blocks scattered across it, and on 4 KB pages nearly every block costs a walk
    through the page tables; one stream's attention ran 10-25% faster on huge
    pages (bench/NOTES.md). Written through once here, as torch.zeros would, so
    the memory is taken at start-up, not fault by fault while serving."""
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    arena = HugePageArena(_aligned(math.prod(shape) * dtype.itemsize))
    return arena.take(tuple(shape), dtype).zero_()


def storage_on_huge_pages(module: nn.Module) -> int:
    """Gives the module's CPU parameters (tied ones once) new storage in one
    HugePageArena, for a checkpoint to fill: their values are not kept (load_model
    calls this before loading; a copy of storage never written would only read the
    kernel's zero page in, 4 KB at a time). Returns the bytes, 0 where huge pages
    are not available."""
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    if not params or not huge_pages_available():
        return 0
    nbytes = HugePageArena.bytes_for(params)
    arena = HugePageArena(nbytes)
    for param in params:
        param.data = arena.take(tuple(param.shape), param.dtype)
    return nbytes
