"""The worker's host memory (services/worker/host_memory.py): a layer's
activations, freed and taken again by the next layer, fault no page in twice;
the weights, and our GEMM's packed copies, each sit on one mapping advised for
transparent huge pages, faulted in by a thread beside the loader."""
import ctypes
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_matmul.gemm import PackedGemmWeights, pack_arena, pack_onto
from services.worker.host_memory import (HUGE_PAGE, HugePageArena, huge_pages_available,
                                         storage_on_huge_pages, zeros_on_huge_pages)
from services.worker.model_loader import checkpoint_arena

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


def resident_bytes(address: int, nbytes: int) -> int:
    """What of [address, address + nbytes) is in memory, page by page (mincore;
    smaps counts a whole mapping, and the kernel merges neighbouring ones)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    pages = -(-(address + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, pages * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) * page


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


@pytest.mark.skipif(not huge_pages_available(), reason="Linux with transparent huge pages only")
def test_an_arena_made_for_them_gives_the_parameters_storage_when_it_has_the_room():
    """load_model's arena made ahead from the checkpoint (checkpoint_arena)."""
    model = nn.Linear(64, 96)
    room = HugePageArena.bytes_for(list(model.parameters()))

    def parameters_within(arena: HugePageArena) -> bool:
        start = arena.take((16,), torch.uint8).data_ptr() + 64  # a probe takes 64 bytes
        storage_on_huge_pages(model, arena)
        return all(start <= p.data_ptr() < start + room for p in model.parameters())

    ahead = HugePageArena(64 + room)
    assert parameters_within(ahead) and ahead.room == 0
    spare = 8 << 20
    larger = HugePageArena(64 + room + spare, populate=True)  # the rest goes back
    assert parameters_within(larger) and larger.room == spare
    larger.populating.join()
    assert resident_bytes(model.weight.data_ptr() + room, spare) < spare // 4
    small = HugePageArena(room)  # the probe leaves too little
    assert not parameters_within(small) and small.room == room - 64  # one of its own


def _populates_write() -> bool:
    """MADV_POPULATE_WRITE came with Linux 5.14."""
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    return release >= (5, 14)


@pytest.mark.skipif(not huge_pages_available() or not _populates_write(),
                    reason="Linux 5.14 or later with transparent huge pages only")
def test_a_populated_arena_faults_in_beside_the_writer_and_keeps_what_it_wrote():
    nbytes = 64 << 20
    cold, warm = HugePageArena(nbytes), HugePageArena(nbytes, populate=True)
    first = warm.copy_of(torch.arange(1 << 20, dtype=torch.float32))  # while it populates
    warm.populating.join()
    assert cold.populating is None
    assert resident_bytes(cold.take((16,), torch.uint8).data_ptr(), nbytes) < nbytes // 8
    assert resident_bytes(first.data_ptr(), nbytes) == nbytes
    assert torch.equal(first, torch.arange(1 << 20, dtype=torch.float32))
    assert not warm.take((nbytes // 4 - (1 << 20),), torch.float32).any()  # the rest: zeros


@pytest.mark.skipif(not huge_pages_available(), reason="Linux with transparent huge pages only")
def test_a_checkpoints_arena_has_room_for_its_tensors_in_the_models_dtype(tmp_path):
    tensors = {"a.weight": torch.zeros(96, 64, dtype=torch.bfloat16),
               "b.weight": torch.zeros(7, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    arena = checkpoint_arena(str(tmp_path), torch.float32)
    assert arena.room == HugePageArena.bytes_for_sizes([96 * 64 * 4, 7 * 4])
    arena.populating.join()


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


@pytest.mark.skipif(not huge_pages_available() or not cpu_ops_available()
                    or not _populates_write(),
                    reason="Linux 5.14 or later with transparent huge pages and the CPU kernels")
def test_a_pack_arena_gives_back_the_pages_16_bit_packs_leave():
    """pack_arena makes room for fp32 packs and populates it; what a bf16 model's
    packs leave goes back (prepare_cpu_linears releases it)."""
    weights = [torch.randn(1024, 1024).to(torch.bfloat16) for _ in range(4)]
    arena = pack_arena(weights)
    strategies = [PackedGemmWeights(w) for w in weights]
    for strategy in strategies:
        pack_onto(arena, strategy)
    first, last = strategies[0].packed, strategies[-1].packed
    taken_end = last.data_ptr() + last.nbytes
    assert arena.room >= 4 << 20  # half the room is left
    arena.populating.join()
    assert resident_bytes(taken_end, arena.room) >= arena.room - HUGE_PAGE
    arena.release_room()
    assert resident_bytes(taken_end, arena.room) <= 64 << 10
    assert resident_bytes(first.data_ptr(), taken_end - first.data_ptr()) >= (
        taken_end - first.data_ptr())
    assert torch.equal(strategies[0](weights[0][:3]), PackedGemmWeights(weights[0])(
        weights[0][:3]))


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
