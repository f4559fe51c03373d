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

Faulting those pages in is most of a worker's load on a machine whose memory
is slow to hand out: an arena can ask for its pages in a thread of its own
while the loader does other work (MADV_POPULATE_WRITE, bench/NOTES.md).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import threading
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


# madvise's advice (Linux 5.14): fault the range in writable as a write would,
# leaving what is written there as it is. Python's mmap module names it from 3.13.
MADV_POPULATE_WRITE = 23
# Each madvise call's part of a populated range: the thread goes back to front
# in these, so that a loader writing from the front meets it halfway.
POPULATE_CHUNK = 32 << 20


def _aligned(nbytes: int) -> int:
    return -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


class HugePageArena:
    """One private anonymous mapping, advised for transparent huge pages and
    aligned to them, handed out front to back as tensors. The mapping
    lives as long as any tensor cut from it.

    populate: fault its pages in from a thread of its own, started here (see
    populate_in_background); what is cut and written meanwhile is kept."""

    def __init__(self, nbytes: int, populate: bool = False):
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        self._region = region
        self._bytes = torch.frombuffer(region, dtype=torch.uint8)
        self._offset = (-self._bytes.data_ptr()) % HUGE_PAGE
        self._end = self._offset + nbytes
        self.populating = (populate_in_background(region, self._bytes.data_ptr() + self._offset,
                                                  nbytes) if populate else None)

    @property
    def room(self) -> int:
        """Bytes not handed out yet."""
        return self._end - self._offset

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

    def release_room(self) -> None:
        """Gives the whole pages of the room not handed out back to the kernel (once
        populated): an arena made ahead may be larger than what it was made for."""
        if self.populating is not None:
            self.populating.join()
        page = mmap.PAGESIZE
        start = -(-self._offset // page) * page
        if start < self._end:
            self._region.madvise(mmap.MADV_DONTNEED, start, self._end - start)


def populate_in_background(region: mmap.mmap, address: int, nbytes: int) -> threading.Thread:
    """Faults in `nbytes` of `region` from `address` (page-aligned) in a daemon
    thread, back to front, and returns it. ctypes lets go of the GIL for each
    call, so Python work (the loader's imports) goes on beside it. Where the
    kernel lacks the advice the thread stops, and pages fault in when written."""
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def populate(region: mmap.mmap) -> None:  # holds the mapping until done
        for start in reversed(range(0, nbytes, POPULATE_CHUNK)):
            if madvise(address + start, min(POPULATE_CHUNK, nbytes - start),
                       MADV_POPULATE_WRITE) != 0:
                return

    thread = threading.Thread(target=populate, args=(region,), name="populate", daemon=True)
    thread.start()
    return thread


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


def storage_on_huge_pages(module: nn.Module, arena: HugePageArena | None = None) -> int:
    """Gives the module's CPU parameters (tied ones once) new storage in one
    HugePageArena, for a checkpoint to fill: their values are not kept (load_model
    calls this before loading; a copy of storage never written would only read the
    kernel's zero page in, 4 KB at a time). `arena`: one made ahead for them, used
    when it has the room, its pages left over released. Returns the bytes, 0 where
    huge pages are not available."""
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    if not params or not huge_pages_available():
        return 0
    nbytes = HugePageArena.bytes_for(params)
    if arena is None or arena.room < nbytes:
        arena = HugePageArena(nbytes)
    for param in params:
        param.data = arena.take(tuple(param.shape), param.dtype)
    if arena.room >= mmap.PAGESIZE:  # made ahead, for more than they took
        arena.release_room()
    return nbytes
