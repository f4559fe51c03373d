"""The C++ causal prefill attention over the paged cache against its torch
reference, and that reference against dense causal attention on the original
K/V: first chunks and continuations, mixed with decodes, in every dtype,
block size and head dim the CPU backend takes."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_build import cpu_ops_available
from kernels.paged_attention import (KERNEL_BLOCK_SIZES, kv_cache_shape, paged_prefill_attention,
                                         paged_prefill_attention_reference, split_kv_cache,
                                         write_kv_cache)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# (tokens already cached, query tokens) per sequence; 1 query token: a decode,
# which the prefill kernel leaves alone.
MIXED = [(0, 37), (5, 1), (100, 60), (0, 1), (17, 2), (0, 200), (3, 16)]


class _Batch:
    """Sequences whose K/V are in a paged cache of scattered blocks, with queries."""

    def __init__(self, seqs, heads, kv_heads, d, block_size, dtype, cache_dtype, seed,
                 unwritten=0.0):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.tensor([p + q for p, q in seqs])
        blocks_each = [-(-n // block_size) for n in self.seq_lens.tolist()]
        num_blocks = sum(blocks_each) + 5
        cache = torch.full(kv_cache_shape(num_blocks, block_size, kv_heads, d), unwritten,
                           dtype=cache_dtype)
        self.key_cache, self.value_cache = split_kv_cache(cache, block_size)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_table = torch.zeros(len(seqs), max(blocks_each), dtype=torch.int64)
        self.keys, self.values = [], []
        for i, n in enumerate(self.seq_lens.tolist()):
            self.block_table[i, :blocks_each[i]] = torch.tensor(free[:blocks_each[i]])
            del free[:blocks_each[i]]
            k, v = (torch.randn(n, kv_heads, d, generator=gen).to(dtype) for _ in range(2))
            pos = torch.arange(n)
            write_kv_cache(k, v, self.key_cache, self.value_cache,
                           self.block_table[i, pos // block_size] * block_size + pos % block_size)
            self.keys.append(k.to(cache_dtype).float())
            self.values.append(v.to(cache_dtype).float())
        self.query_start_loc = torch.tensor([0] + [q for _, q in seqs]).cumsum(0)
        self.query = torch.randn(int(self.query_start_loc[-1]), heads, d, generator=gen).to(dtype)
        self.scale = d ** -0.5

    def run(self, attention) -> torch.Tensor:
        out = torch.full_like(self.query, 7.0)  # rows the call must leave alone keep 7
        attention(self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                  self.query_start_loc, self.scale, out)
        return out

    def dense(self) -> torch.Tensor:
        """Causal attention of each prefill's queries on its original K/V, fp32."""
        out = torch.full(self.query.shape, 7.0)
        for i, n in enumerate(self.seq_lens.tolist()):
            start, end = self.query_start_loc[i].item(), self.query_start_loc[i + 1].item()
            if end - start < 2:
                continue
            q = self.query[start:end].float().transpose(0, 1)
            mask = torch.arange(n)[None, :] <= torch.arange(n - (end - start), n)[:, None]
            out[start:end] = F.scaled_dot_product_attention(
                q[None], self.keys[i].transpose(0, 1)[None], self.values[i].transpose(0, 1)[None],
                attn_mask=mask, scale=self.scale, enable_gqa=True)[0].transpose(0, 1)
        return out


def _check(batch: _Batch, dtype) -> None:
    # The op itself, not the wrapper, which would take the reference for a shape the
    # kernel is not built for.
    assert cpu_ops_available()
    got = batch.run(torch.ops.llmserve.paged_prefill_attention)
    want = batch.dense()
    reference = batch.run(paged_prefill_attention_reference)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(reference.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 8), (4, 1), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", KERNEL_BLOCK_SIZES)
def test_prefill_attention_equals_dense_causal_attention(heads, kv_heads, dtype, block_size):
    """Every block size the kernel is built for. Query heads per KV head: 1, 2,
    3, 4 (tiles of 48, 24 and 16 positions)."""
    _check(_Batch(MIXED, heads, kv_heads, 64, block_size, dtype, dtype, seed=block_size + heads),
           dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_prefill_attention_head_dims(head_dim, dtype):
    """Each compiled head dim; at 96 and 128, passes of 2 query rows. In bf16 the
    scores multiply bf16 pairs of d where the kernels have AVX512-BF16."""
    _check(_Batch(MIXED, 9, 3, head_dim, 16, dtype, dtype, seed=head_dim), dtype)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_prefill_over_a_sixteen_bit_cache_keeps_fp32(cache_dtype):
    batch = _Batch(MIXED, 9, 3, 64, 16, torch.float32, cache_dtype, seed=3)
    got = batch.run(paged_prefill_attention)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, batch.dense(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_long_prompt_after_a_long_context(dtype):
    """Tiles of one sequence shared out over the threads, each walking its own
    causal reach over 40 scattered blocks."""
    _check(_Batch([(500, 130)], 9, 3, 64, 16, dtype, dtype, seed=5), dtype)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_slots_nobody_wrote_leave_the_output_alone(dtype, block_size):
    """A block's slots past a sequence's last token hold whatever an earlier
    sequence left, NaN included. Their probabilities are 0, and 0 x NaN would
    still be NaN: the kernel must not multiply them (on AMX, where tiles take
    32 tokens at a time, the values past the reach are zeros instead)."""
    _check(_Batch(MIXED, 9, 3, 64, block_size, dtype, dtype, seed=13, unwritten=float("nan")),
           dtype)


def test_a_query_viewed_in_the_qkv_rows_is_read_in_place():
    """The model passes q as a view into its qkv projection (each token's row
    wider than its heads): the kernel reads it there, and gives the very numbers
    it gives for the same query made contiguous (the reference's differ in the
    last bits, so equality also says the kernel ran)."""
    batch = _Batch(MIXED, 9, 3, 64, 16, torch.float32, torch.float32, seed=11)
    contiguous = batch.run(paged_prefill_attention)
    tokens, heads, d = batch.query.shape
    qkv = torch.randn(tokens, (heads + 2 * 3) * d)
    qkv[:, :heads * d] = batch.query.reshape(tokens, heads * d)
    batch.query = qkv[:, :heads * d].view(tokens, heads, d)
    assert not batch.query.is_contiguous()
    out = torch.full(batch.query.shape, 7.0)
    paged_prefill_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_table,
                            batch.seq_lens, batch.query_start_loc, batch.scale, out)
    assert torch.equal(out, contiguous)
