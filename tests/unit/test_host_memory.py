"""The worker keeps the memory a step frees (services/worker/host_memory.py): a
layer's activations, freed and taken again by the next layer, fault no page in
twice."""
import ctypes
import subprocess
import sys

import pytest

# A fresh interpreter per case: mallopt's settings last for the process. The
# blocks come from glibc's malloc, as torch's CPU tensors do; their sizes are a
# 2,048-token prefill's (MB), all alive at once, then freed.
_LAYERS = """
import ctypes, resource, sys
from services.worker.host_memory import keep_freed_host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "kept":
    assert keep_freed_host_memory()
SIZES = [mb << 20 for mb in (24, 12, 12, 8)]
def layer():
    blocks = [libc.malloc(size) for size in SIZES]
    for block, size in zip(blocks, SIZES):
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
_PAGES_PER_LAYER = (24 + 12 + 12 + 8) << 20 >> 12


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LAYERS, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def _has_glibc_mallopt() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not _has_glibc_mallopt(), reason="glibc's malloc only")
def test_a_layers_freed_activations_are_reused_without_page_faults():
    # glibc's defaults: the freed blocks coalesce at the heap's top beyond its
    # (dynamic) trim threshold and go back to the kernel, so every layer faults
    # them in again.
    assert _faults("default") > 10 * _PAGES_PER_LAYER // 2
    assert _faults("kept") < _PAGES_PER_LAYER // 10
