"""The worker's host memory (services/worker/host_memory.py): a layer's
activations, freed and taken again by the next layer, fault no page in twice;
the weights, and our GEMM's packed copies, each sit on one mapping advised for
transparent huge pages."""
import ctypes
import subprocess
import sys

import pytest
import torch
from torch import nn

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_matmul.gemm import PackedGemmWeights, pack_arena, pack_onto
from services.worker.host_memory import (HUGE_PAGE, HugePageArena, huge_pages_available,
                                         storage_on_huge_pages, zeros_on_huge_pages)

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


def mapping_of(address: int) -> tuple[int, set[str]]:
    """The start of the mapping that holds `address`, and the kernel's flags for it
    (/proc/self/smaps; "hg": advised for transparent huge pages)."""
    low = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(" ", 1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(end, 16) for end in first.split("-"))
                low = lo if lo <= address < hi else None
            elif low is not None and line.startswith("VmFlags:"):
                return low, set(line.split()[1:])
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not huge_pages_available(), reason="Linux with transparent huge pages only")
def test_parameters_take_storage_on_one_huge_page_mapping_for_a_checkpoint():
    """load_model's move, before it loads the checkpoint: storage only, nothing
    copied; tied parameters stay one."""
    model = nn.ModuleDict({"embed": nn.Embedding(1000, 64), "proj": nn.Linear(64, 96),
                           "head": nn.Linear(64, 1000, bias=False)})
    model["head"].weight = model["embed"].weight  # tied, as SmolLM2's head is
    params = list(model.parameters())
    assert storage_on_huge_pages(model) == sum(-(-p.nbytes // 64) * 64 for p in params)
    assert model["head"].weight is model["embed"].weight
    assert all(isinstance(p, nn.Parameter) and p.data_ptr() % 64 == 0 and not p.any()
               for p in params)
    starts = sorted(p.data_ptr() for p in params)
    assert starts[0] % HUGE_PAGE == 0
    mappings = {mapping_of(start)[0] for start in starts}
    assert len(mappings) == 1 and "hg" in mapping_of(starts[0])[1]
    with torch.no_grad():
        model["proj"].weight.copy_(torch.ones(96, 64))  # a checkpoint's load
    assert model["proj"](model["embed"](torch.tensor([1, 2]))).shape == (2, 96)
    assert model["proj"].weight.sum() == 96 * 64


@pytest.mark.skipif(not huge_pages_available() or not cpu_ops_available(),
                    reason="Linux with transparent huge pages and the CPU kernels only")
def test_packed_gemm_weights_move_onto_one_huge_page_mapping_unchanged():
    """The fp32 path's packed copies, which every step above one row streams: each
    moved as it is made (prepare_cpu_linears), into room made for all of them."""
    weights = [torch.randn(96, 32), torch.randn(50, 16), torch.randn(7, 48)]
    arena = pack_arena(weights)
    strategies = [PackedGemmWeights(w) for w in weights]
    x = [torch.randn(5, w.shape[1]) for w in weights]
    before = [s(xi) for s, xi in zip(strategies, x)]
    for strategy in [*strategies, nn.Identity()]:
        pack_onto(arena, strategy)
    assert all(torch.equal(s(xi), want) for s, xi, want in zip(strategies, x, before))
    starts = [s.packed.data_ptr() for s in strategies]
    assert len({mapping_of(start)[0] for start in starts}) == 1
    assert "hg" in mapping_of(starts[0])[1]
    with pytest.raises(ValueError, match="cannot hold"):  # the room was all taken
        arena.take((1024,), torch.float32)


@pytest.mark.skipif(not huge_pages_available(), reason="Linux with transparent huge pages only")
def test_a_kv_cache_takes_zeros_on_a_huge_page_mapping_of_its_own():
    """The worker's KV cache (ModelRunner._allocate_kv_cache on the CPU)."""
    caches = [zeros_on_huge_pages((3, 2, 7, 16), dtype) for dtype in (torch.float32,
                                                                      torch.bfloat16)]
    for cache, dtype in zip(caches, (torch.float32, torch.bfloat16)):
        assert cache.shape == (3, 2, 7, 16) and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.any()
        assert cache.data_ptr() % HUGE_PAGE == 0 and "hg" in mapping_of(cache.data_ptr())[1]
    caches[0].fill_(1.0)  # each its own mapping: writing one leaves the other as it was
    assert not caches[1].any()


def test_an_arena_refuses_what_it_cannot_hold():
    arena = HugePageArena(128)
    arena.copy_of(torch.zeros(16))
    with pytest.raises(ValueError, match="cannot hold"):
        arena.copy_of(torch.zeros(32))
