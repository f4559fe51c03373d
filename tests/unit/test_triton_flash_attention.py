"""Our Triton FlashAttention kernel (kernels/triton_flash_attention.py) in Triton's
interpreter, against the torch reference of flash_attn_varlen_func. tests/gpu runs the same
cases compiled on a GPU."""
import os

# Before anything imports triton: run Triton kernels with its interpreter on CPU tensors.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.references.flash_attn import flash_attn_varlen_func_reference  # noqa: E402
from tests.references.paged_attention_cases import BATCHES, random_paged_case  # noqa: E402

triton = pytest.importorskip("triton", reason="pip install -e '.[test]' brings triton")
from kernels.triton_flash_attention import flash_attn_varlen_func  # noqa: E402


def _compare(case, causal: bool, atol: float) -> None:
    kwargs = dict(softmax_scale=0.3, causal=causal, block_table=case.block_table)
    actual = flash_attn_varlen_func(*case.args(), **kwargs)
    expected = flash_attn_varlen_func_reference(*case.args(), **kwargs)
    assert actual.dtype == case.q.dtype and actual.shape == case.q.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_matches_reference_on_each_batch_shape(batch):
    case = random_paged_case(BATCHES[batch], 16, 6, 2, 8, torch.float32, seed=len(batch))
    _compare(case, causal=True, atol=1e-5)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [
    (5, 4, 4, 12),  # a block size no power of two divides, no GQA, head_dim padded to 16
    (32, 8, 1, 16),  # multi-query attention, one BLOCK_N tile per block
    (1, 2, 2, 4),
])
def test_matches_reference_for_any_block_size_and_head_layout(block_size, heads, kv_heads,
                                                              head_dim):
    case = random_paged_case(BATCHES["mixed"], block_size, heads, kv_heads, head_dim,
                             torch.float32, seed=block_size)
    _compare(case, causal=True, atol=1e-5)


def test_not_causal_and_half_precision():
    case = random_paged_case(BATCHES["mixed"], 16, 4, 2, 8, torch.float16, seed=3)
    _compare(case, causal=False, atol=2e-3)


def test_refuses_what_it_cannot_read():
    case = random_paged_case(BATCHES["decodes"], 16, 4, 2, 8, torch.float32)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(*case.args())
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        flash_attn_varlen_func(*case.args(), block_table=case.block_table.long())
    with pytest.raises(ValueError, match="must divide"):
        flash_attn_varlen_func(case.q[:, :3], *case.args()[1:], block_table=case.block_table)
