"""The C++ CPU decode-attention kernel against its torch reference."""
import pytest
import torch

from kernels.cpu_paged_attention import (load_kernel, paged_decode_attention,
                                         paged_decode_attention_reference)


def test_the_kernel_builds_here():
    assert load_kernel() is not None, "see the warning above: compiler, headers or ninja missing"


@pytest.mark.parametrize("batch, heads, kv_heads, max_len", [(1, 9, 3, 1), (7, 9, 3, 70),
                                                              (5, 4, 4, 33), (3, 8, 1, 130)])
def test_kernel_equals_reference(batch, heads, kv_heads, max_len):
    torch.manual_seed(batch)
    num_blocks, block_size, d = 64, 16, 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    query = torch.randn(batch, heads, d)
    seq_lens = torch.randint(1, max_len + 1, (batch,))
    seq_lens[0] = max_len
    block_table = torch.randperm(num_blocks)[:batch * 9].reshape(batch, 9)
    block_table = block_table[:, :-(-max_len // block_size)]
    got = paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, 0.125)
    want = paged_decode_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                            0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
