"""The C++ paged KV cache kernels (write, decode attention) against their torch
references, in every dtype and block size the CPU backend takes."""
import pytest
import torch

from kernels.cpu_build import cpu_ops_available
from kernels.paged_attention import (KERNEL_BLOCK_SIZES, kv_cache_shape, paged_decode_attention,
                                         paged_decode_attention_reference, split_kv_cache,
                                         write_kv_cache, write_kv_cache_reference)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_the_kernels_build_here():
    assert cpu_ops_available(), "see the warning above: compiler, headers or ninja missing"


def _caches(num_blocks, block_size, kv_heads, d, dtype, gen):
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, d), generator=gen)
    return split_kv_cache(cache.to(dtype), block_size)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_equals_reference(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, d, num_blocks = 3, 64, 8
    key_cache, value_cache = _caches(num_blocks, block_size, kv_heads, d, dtype, gen)
    expected = (key_cache.clone(), value_cache.clone())
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    k = torch.randn(40, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(40, kv_heads, d, generator=gen).to(dtype)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    write_kv_cache_reference(k, v, *expected, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


@pytest.mark.parametrize("batch, heads, kv_heads, max_len", [(1, 9, 3, 1), (7, 9, 3, 70),
                                                              (5, 4, 4, 33), (3, 8, 1, 130),
                                                              (2, 9, 3, 300), (12, 9, 3, 70),
                                                              (9, 8, 2, 40), (1, 9, 3, 1000),
                                                              (10, 9, 3, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", KERNEL_BLOCK_SIZES)
def test_decode_attention_equals_reference(batch, heads, kv_heads, max_len, dtype, block_size):
    """Every block size the kernel is built for. Groups of 1, 3, 4 and 8 query
    heads per KV head: one pass, or two passes of 4 heads. Keys are scored a
    block at a time with AVX-512 off Intel, four blocks at a time and then one
    on Intel (70 tokens: 4 + 1 blocks of 16), two and then one with AVX2
    (test_avx2_kernels: 2 + 2 + 1). With at
    least 4 sequences a thread (12 and 9 on 2 cores), an item is a whole
    sequence; otherwise the batch's blocks are cut into a run a thread, and the
    runs into chunks where sequences end, the chunks' softmax partials merged
    after (1,000 tokens: 63 blocks of 16 in runs of 32 on 2 cores). Where a walk
    asks for lines blocks ahead (streams_ahead: 16-bit walks, and off Intel fp32
    walks of whole sequences), the blocks asked for lie in its own walk (300
    tokens: 19 blocks of 16), in the values after the keys, or in the next
    sequence's keys (70 tokens)."""
    _check_decode(batch, heads, kv_heads, 64, max_len, dtype, block_size)


@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_cut_into_runs(threads, dtype):
    """With more threads than sequences, a sequence spans several threads' runs,
    a chunk in each, merged after: here 63 blocks and 27, in runs of 30 (3
    threads) or 23 (4), the first sequence in three chunks, the second in one or
    two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_decode(2, 9, 3, 64, 1000, dtype, 16)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (7, 1)])
def test_decode_attention_head_dims(head_dim, heads, kv_heads):
    """Each compiled head dim; at 128, passes of 2 query heads (3 = 2 + 1)."""
    _check_decode(4, heads, kv_heads, head_dim, 50, torch.float32, 16)


def _check_decode(batch, heads, kv_heads, d, max_len, dtype, block_size):
    gen = torch.Generator().manual_seed(batch * 1000 + max_len + d)
    width = -(-max_len // block_size)
    num_blocks = max(64, batch * width)
    key_cache, value_cache = _caches(num_blocks, block_size, kv_heads, d, dtype, gen)
    query = torch.randn(batch, heads, d, generator=gen).to(dtype)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    seq_lens[0] = max_len
    block_table = torch.randperm(num_blocks, generator=gen)[:batch * width].reshape(batch, width)
    # The op itself, not the wrapper, which would take the reference for a shape the
    # kernel is not built for (and compare the reference with itself).
    got = torch.ops.llmserve.paged_decode_attention(query, key_cache, value_cache, block_table,
                                                    seq_lens, 0.125)
    want = paged_decode_attention_reference(query.float(), key_cache.float(), value_cache.float(),
                                            block_table, seq_lens, 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_cache_under_an_fp32_query(cache_dtype):
    """The opt-in 16-bit KV cache: the kernel reads the rounded values exactly as
    the reference does, and keeps the query, sums and output in fp32."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, kv_heads, d = 32, 16, 3, 64
    key_cache, value_cache = _caches(num_blocks, block_size, kv_heads, d, cache_dtype, gen)
    k = torch.randn(20, kv_heads, d, generator=gen)
    v = torch.randn(20, kv_heads, d, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    write_kv_cache(k, v, key_cache, value_cache, slots)
    expected = _caches(num_blocks, block_size, kv_heads, d, cache_dtype,
                       torch.Generator().manual_seed(7))
    write_kv_cache_reference(k, v, *expected, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    query = torch.randn(4, 9, d, generator=gen)
    seq_lens = torch.tensor([70, 1, 33, 64])
    block_table = torch.randperm(num_blocks, generator=gen)[:20].reshape(4, 5)
    got = paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, 0.125)
    want = paged_decode_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                            0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_q_k_v_in_place_as_views_of_the_fused_projection(dtype):
    """In the model q, k and v are column slices of one [T, (H + 2 KV) * D] qkv
    output: the kernels take their token stride as it is, without copies, and
    give what the references give on contiguous copies."""
    gen = torch.Generator().manual_seed(11)
    batch, heads, kv_heads, d, block_size, num_blocks = 6, 9, 3, 64, 16, 48
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, v = (part.view(batch, -1, d) for part in
               qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    assert not k.is_contiguous()
    key_cache, value_cache = _caches(num_blocks, block_size, kv_heads, d, dtype, gen)
    expected = (key_cache.clone(), value_cache.clone())
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:batch]
    write_kv_cache(k, v, key_cache, value_cache, slots)
    write_kv_cache_reference(k.contiguous(), v.contiguous(), *expected, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    seq_lens = torch.tensor([40, 1, 17, 64, 33, 5])
    block_table = torch.randperm(num_blocks, generator=gen)[:batch * 4].reshape(batch, 4)
    got = paged_decode_attention(q, key_cache, value_cache, block_table, seq_lens, 0.125)
    want = paged_decode_attention(q.contiguous(), key_cache, value_cache, block_table, seq_lens,
                                  0.125)
    assert got.is_contiguous() and torch.equal(got, want)
