"""The CUDA attention path on the CPU: the Triton K/V store kernel (interpreted) and the
FlashAttention backend driven by a torch reference of flash_attn_varlen_func."""
import os

# Before anything imports triton: run Triton kernels with its interpreter on CPU tensors.
os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from services.worker.attention import AttentionMetadata, CpuPagedBackend  # noqa: E402
from tests.references.flash_attn import flash_attn_varlen_func_reference  # noqa: E402
from tests.references.paged_attention_cases import build_metadata  # noqa: E402
from tests.references.paged_kv_store import store_kv_cache_reference  # noqa: E402

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(
    not HAS_TRITON,
    reason="triton is not installed (pip install -e '.[test]' brings triton==3.9.0)")
if HAS_TRITON:
    from kernels.paged_kv_store import store_kv_cache
    from services.worker.attention.flash_attn import FlashAttentionBackend, cumulative_seq_lens

BLOCK_SIZE = 16
NUM_BLOCKS = 24
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


# --- the Triton store kernel -------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,block_size,block,dtype", [
    (6, 2, 8, 16, None, torch.float32),  # one loop step covers the 16-element row
    (7, 3, 8, 16, 16, torch.float32),  # a 24-element row in two steps, the second masked
    (5, 1, 4, 4, None, torch.float16),
])
def test_store_kernel_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, block,
                                        dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks, row = 6, num_kv_heads * head_dim
    # K and V as the model makes them: strided views into one packed projection.
    packed = torch.randn(num_tokens, 2 * row + 3, generator=gen).to(dtype)
    k = packed[:, :row].view(num_tokens, num_kv_heads, head_dim)
    v = packed[:, row:2 * row].view(num_tokens, num_kv_heads, head_dim)
    # Distinct slots in scrambled order, one token skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    initial = torch.randn(*cache_shape, generator=gen).to(dtype)
    cache, expected = initial.clone(), initial.clone()

    store_kv_cache(k, v, cache, slots, block=block)
    store_kv_cache_reference(k, v, expected, slots)

    assert torch.equal(cache, expected)
    # And the reference does what it says: written slots hold k/v, the others are untouched.
    written = slots[slots >= 0]
    flat, flat_initial = (c.view(2, -1, num_kv_heads, head_dim) for c in (expected, initial))
    assert torch.equal(flat[0, written], k[slots >= 0])
    assert torch.equal(flat[1, written], v[slots >= 0])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], flat_initial[:, untouched])


@needs_triton
def test_store_kernel_rejects_a_block_that_is_not_a_power_of_two():
    k = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="power of two"):
        store_kv_cache(k, k, torch.zeros(2, 1, 4, 1, 4), torch.zeros(1, dtype=torch.int64), block=3)


# --- the flash-attn reference on its own -------------------------------------------------

@pytest.mark.parametrize("len_q,len_k,expected_mask", [
    # The two examples in flash_attn_varlen_func's docstring (1 = keep); an all-masked row is 0.
    (2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
    (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]),
])
def test_reference_causal_mask_is_bottom_right_aligned(len_q, len_k, expected_mask):
    # Zero queries give equal scores, and one-hot values make each output row its weights.
    q = torch.zeros(len_q, 1, len_k)
    k = torch.randn(len_k, 1, len_k)
    v = torch.eye(len_k).unsqueeze(1)
    out = flash_attn_varlen_func_reference(
        q, k, v, torch.tensor([0, len_q], dtype=torch.int32),
        torch.tensor([0, len_k], dtype=torch.int32), len_q, len_k, causal=True)
    mask = torch.tensor(expected_mask, dtype=torch.float32)
    weights = mask / mask.sum(-1, keepdim=True).clamp_min(1)
    torch.testing.assert_close(out[:, 0], weights)


# --- the backend against torch SDPA ------------------------------------------------------

# Each request: (tokens already in the cache, tokens scheduled this step).
BATCHES = {
    "mixed": [(20, 1), (0, 7), (18, 9), (33, 1), (0, 16), (16, 5)],
    "decodes": [(5, 1), (47, 1), (16, 1)],
    "prefills": [(0, 3), (0, 17)],
    "one_chunk": [(31, 12)],
}


@needs_triton
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_backend_matches_cpu_paged(batch):
    requests = BATCHES[batch]
    gen = torch.Generator().manual_seed(sorted(BATCHES).index(batch))
    meta = build_metadata(requests, _random_block_ids(requests, gen), BLOCK_SIZE)
    q, k, v, initial = _random_inputs(meta, gen)
    scale = HEAD_DIM ** -0.5
    paged, flash = CpuPagedBackend(), FlashAttentionBackend(flash_attn_varlen_func_reference)
    flash_cache = initial.clone()
    paged_cache = torch.empty(paged.kv_cache_shape(initial.shape[1], BLOCK_SIZE,
                                                   *initial.shape[3:]))
    for logical, content in zip(paged.logical_kv(paged_cache, BLOCK_SIZE), initial):
        logical.copy_(content)

    expected = paged.forward(q, k, v, paged.bind_cache(paged_cache, BLOCK_SIZE), meta, scale)
    actual = flash.forward(q, k, v, flash.bind_cache(flash_cache, BLOCK_SIZE), meta, scale)

    assert actual.shape == q.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(flash.logical_kv(flash_cache, BLOCK_SIZE),
                    paged.logical_kv(paged_cache, BLOCK_SIZE)):
        assert torch.equal(a, b)


@needs_triton
def test_backend_makes_one_varlen_call_with_flash_attn_types():
    requests = BATCHES["mixed"]
    gen = torch.Generator().manual_seed(1)
    meta = build_metadata(requests, _random_block_ids(requests, gen), BLOCK_SIZE)
    q, k, v, cache = _random_inputs(meta, gen)
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return flash_attn_varlen_func_reference(*args, **kwargs)

    FlashAttentionBackend(spy).forward(q, k, v, cache, meta, 0.5)

    assert len(calls) == 1
    (q_arg, k_arg, v_arg, cu_q, cu_k, max_q, max_k), kwargs = calls[0]
    assert q_arg is q
    assert k_arg.data_ptr() == cache[0].data_ptr() and v_arg.data_ptr() == cache[1].data_ptr()
    assert cu_q.dtype == cu_k.dtype == kwargs["block_table"].dtype == torch.int32
    assert cu_k.tolist() == [0, *np.cumsum(meta.seq_lens).tolist()]
    assert (max_q, max_k) == (meta.max_query_len, meta.max_seq_len)
    assert kwargs["causal"] is True and kwargs["softmax_scale"] == 0.5


@needs_triton
def test_cumulative_seq_lens():
    out = cumulative_seq_lens(torch.tensor([3, 1, 4], dtype=torch.int32))
    assert out.dtype == torch.int32 and out.tolist() == [0, 3, 4, 8]


@needs_triton
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="flash-attn is installed here")
def test_backend_without_flash_attn_says_how_to_get_it():
    with pytest.raises(ImportError, match="needs flash-attn"):
        FlashAttentionBackend()


# --- helpers -------------------------------------------------------------------------------

def _random_block_ids(requests: list[tuple[int, int]], gen: torch.Generator) -> list[list[int]]:
    """Disjoint blocks in scrambled order, as many as each request's tokens need."""
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    needed = [-(-(done + new) // BLOCK_SIZE) for done, new in requests]
    assert sum(needed) <= NUM_BLOCKS
    return [[free.pop() for _ in range(n)] for n in needed]


def _random_inputs(meta: AttentionMetadata, gen: torch.Generator):
    """q, k, v for the step's tokens and a cache full of random values.

    The random cache stands in for the cached context, and for stale data past each
    sequence's end that neither backend may read.
    """
    num_tokens = meta.query_start_loc[-1]
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, cache
