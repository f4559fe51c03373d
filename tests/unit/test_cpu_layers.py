"""The C++ element-wise layer kernels against their torch references (which are
transformers' formulas), in fp32, bf16 and fp16."""
import pytest
import torch

from kernels import cpu_layers as L

# fp32: the kernels' sums and exp differ from torch's in the last bits only.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


# 576: whole vectors of 16; 100: a tail the kernels finish element by element.
WIDTHS = [576, 100]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, width):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, width, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(width, generator=gen) * 0.2).to(dtype)
    close(L.rms_norm(x, weight, 1e-5), L.rms_norm_reference(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, width):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(19, width, generator=gen).to(dtype)
    residual = torch.randn(19, width, generator=gen).to(dtype)
    weight = (1 + torch.randn(width, generator=gen) * 0.2).to(dtype)
    x2, residual2 = x.clone(), residual.clone()
    L.fused_add_rms_norm(x, residual, weight, 1e-6)
    L.fused_add_rms_norm_reference(x2, residual2, weight, 1e-6)
    assert torch.equal(residual, residual2)  # the add is exact to the dtype
    close(x, x2, dtype)
    # Whole vectors (576) take a two-pass path, a tail (100) rms_norm's rows: both
    # sum the squares in rms_norm's order, so the bits are rms_norm's.
    assert torch.equal(x, L.rms_norm(residual, weight, 1e-6))


@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_on_views_of_a_packed_projection(dtype, d):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, max_pos = 9, 3, 300
    qkv = torch.randn(23, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.arange(max_pos)[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    cos_sin = torch.stack((angles.cos(), angles.sin()), dim=1)  # [max_pos, 2, d / 2]
    positions = torch.randint(0, max_pos, (23,), generator=gen)
    expected = qkv.clone()

    def views(t):
        q, k, _ = t.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return q.view(-1, heads, d), k.view(-1, kv_heads, d)

    L.rotary_embedding(*views(qkv), positions, cos_sin)
    L.rotary_embedding_reference(*views(expected), positions, cos_sin)
    close(qkv, expected, dtype)
    assert torch.equal(qkv[:, -kv_heads * d:], expected[:, -kv_heads * d:])  # v untouched


@pytest.mark.parametrize("width", [1536, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, width):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(41, 2 * width, generator=gen) * 4).to(dtype)
    close(L.silu_and_mul(gate_up), L.silu_and_mul_reference(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_keeps_nan_and_overflows_to_inf_in_16_bits(dtype):
    """SiLU(gate) is rounded to the dtype in registers before the product: NaN stays
    NaN, and a product past the dtype's range is inf, as in the reference; over whole
    vectors and the tail (width 18)."""
    big, nan = torch.finfo(dtype).max, float("nan")
    gate = torch.tensor([nan, 1.0, big, 2.0, -3.0, 0.5] * 3)
    up = torch.tensor([1.0, nan, 4.0, big, 0.25, -2.0] * 3)
    gate_up = torch.cat([gate, up]).to(dtype).repeat(3, 1)
    got, want = L.silu_and_mul(gate_up), L.silu_and_mul_reference(gate_up)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 18
    assert torch.equal(got.isinf(), want.isinf()) and got.isinf().sum() == 18
    finite = want.isfinite()
    close(got[finite], want[finite], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torch_argmax_ties_included(dtype):
    """16-bit logits (a 16-bit model's greedy step) give the argmax of their exact
    fp32 widening; bf16 rounding makes ties common, so the first-index rule is
    exercised throughout."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 49152, generator=gen)
    logits[3, [10, 20000, 40000]] = 50.0  # a tie: the first index wins
    logits[5, :] = 1.0
    logits[6, [49151, 49150]] = 60.0  # in the tail past the last whole vector
    logits[7, [17, 1]] = 70.0  # same lane order reversed
    logits = logits.to(dtype)
    got = L.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[3] == 10 and got[5] == 0 and got[6] == 49150 and got[7] == 1
    odd = torch.randn(5, 49157, generator=gen).to(dtype)  # a tail of 5
    odd[2, -1] = 99.0
    odd[4, [3, 49156]] = 99.0  # a tie between a vector lane and the tail
    assert torch.equal(L.argmax_rows(odd), odd.float().argmax(-1))
