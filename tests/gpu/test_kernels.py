"""The CUDA kernels, compiled on the GPU, against their torch references: the Triton
FlashAttention kernel (triton_attn), flash-attn 2 where it is installed (flash_attn), the
Triton K/V store, and the backend's whole step (store, then attention)."""
import importlib.util

import pytest
import torch

from services.worker.attention import CpuPagedBackend
from tests.references.flash_attn import flash_attn_varlen_func_reference
from tests.references.paged_attention_cases import BATCHES, build_metadata, random_paged_case
from tests.references.paged_kv_store import store_kv_cache_reference

CUDA = "cuda"
# The default model's layout (9 query heads on 3 KV heads, 64 dims), a wider one, and MQA.
LAYOUTS = [(9, 3, 64), (32, 8, 128), (8, 1, 64)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _check(varlen_fn, case, causal=True):
    kwargs = dict(softmax_scale=case.q.shape[-1] ** -0.5, causal=causal,
                  block_table=case.block_table)
    actual = varlen_fn(*case.args(), **kwargs)
    expected = flash_attn_varlen_func_reference(*case.args(), **kwargs)
    assert actual.shape == case.q.shape and actual.dtype == case.q.dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0,
                               atol=TOLERANCE[case.q.dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_triton_attn_matches_reference(batch, layout, block_size, dtype):
    from kernels.triton_flash_attention import flash_attn_varlen_func
    case = random_paged_case(BATCHES[batch], block_size, *layout, dtype, CUDA, seed=block_size)
    _check(flash_attn_varlen_func, case)


def test_triton_attn_not_causal():
    from kernels.triton_flash_attention import flash_attn_varlen_func
    case = random_paged_case(BATCHES["mixed"], 16, 9, 3, 64, torch.bfloat16, CUDA)
    _check(flash_attn_varlen_func, case, causal=False)


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash-attn is not installed on this machine "
                    "(PyPI has only its sdist; tests/gpu/README.md)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_flash_attn_matches_reference(batch, dtype):
    from flash_attn import flash_attn_varlen_func
    case = random_paged_case(BATCHES[batch], 256, 9, 3, 64, dtype, CUDA)
    _check(flash_attn_varlen_func, case)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,block_size", [
    (1, 3, 64, 16), (37, 3, 64, 16), (300, 8, 128, 32), (5, 1, 4, 256)])
def test_kv_store_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype):
    from kernels.paged_kv_store import store_kv_cache
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks, row = -(-num_tokens // block_size) + 4, num_kv_heads * head_dim
    # K and V as the model makes them: strided views into one packed projection.
    packed = torch.randn(num_tokens, 2 * row + 3, generator=gen).to(dtype).to(CUDA)
    k = packed[:, :row].view(num_tokens, num_kv_heads, head_dim)
    v = packed[:, row:2 * row].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(CUDA)
    slots[num_tokens // 2] = -1
    initial = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                          generator=gen).to(dtype).to(CUDA)
    cache, expected = initial.clone(), initial.clone()
    store_kv_cache(k, v, cache, slots)
    store_kv_cache_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("backend_name", ["triton_attn", "flash_attn"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_backend_step_matches_cpu_paged(batch, backend_name):
    """One step as the model runs it: new K/V stored, then attention over the paged cache,
    against cpu_paged's torch path on the same GPU."""
    from services.worker.attention import make_attention_backend
    if backend_name == "flash_attn" and not HAS_FLASH_ATTN:
        pytest.skip("flash-attn is not installed on this machine")
    block_size = 256 if backend_name == "flash_attn" else 16
    backend = make_attention_backend(backend_name, torch.device(CUDA), block_size,
                                     torch.bfloat16)
    case = random_paged_case(BATCHES[batch], block_size, 9, 3, 64, torch.bfloat16, CUDA)
    requests = BATCHES[batch]
    blocks = [row[:-(-(d + n) // block_size)].tolist()
              for row, (d, n) in zip(case.block_table.cpu(), requests)]
    meta = _to_cuda(build_metadata(requests, blocks, block_size))
    num_new = case.q.shape[0]
    k_new = torch.randn(num_new, 3, 64, device=CUDA, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    cache = torch.stack([case.k_cache, case.v_cache])
    reference = CpuPagedBackend()
    ref_cache = torch.empty(reference.kv_cache_shape(cache.shape[1], block_size, 3, 64),
                            dtype=cache.dtype, device=CUDA)
    for logical, content in zip(reference.logical_kv(ref_cache, block_size), cache):
        logical.copy_(content)
    expected = reference.forward(case.q, k_new, v_new, reference.bind_cache(ref_cache,
                                 block_size), meta, 0.125)
    actual = backend.forward(case.q, k_new, v_new, backend.bind_cache(cache, block_size), meta,
                             0.125)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=2e-2)


def _to_cuda(meta):
    import dataclasses
    return dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).to(CUDA) for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)})
