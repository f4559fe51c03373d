"""The CPU linear paths: the 16-bit-weight GEMV kernel against its definition,
and each layer set-up of cpu_linear against F.linear."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_linear import GEMV_MAX_ROWS, matmul, prepare_cpu_linears
from services.worker.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear


@pytest.fixture(autouse=True, scope="module")
def kernels_built():
    assert cpu_ops_available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [576, 80, 1536])
def test_gemv_reads_16bit_weights_with_fp32_sums(rows, weight_dtype, k):
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen)
    weight = (torch.randn(291, k, generator=gen) * 0.05).to(weight_dtype)
    got = torch.ops.llmserve.gemv_16bit_weights(x, weight)
    want = F.linear(x.double(), weight.double()).float()  # the exact sums of the same values
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ColumnParallelLinear(64, 96, bias=True)
        self.b = RowParallelLinear(96, 64, bias=False)
        self.head = ParallelLMHead(300, 64)
        for p in self.parameters():
            nn.init.normal_(p, std=0.1)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_sixteen_bit_weights_serve_few_rows_and_fp32_weights_the_rest():
    model = Tiny()
    x = torch.randn(GEMV_MAX_ROWS + 5, 64)
    exact = model(x)
    assert prepare_cpu_linears(model, torch.float32, torch.bfloat16).startswith("bfloat16")
    rounded = Tiny()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() if k.endswith("weight") else v
                             for k, v in model.state_dict().items()})  # biases stay fp32
    few = x[:GEMV_MAX_ROWS]
    torch.testing.assert_close(model(few), rounded(few), rtol=1e-5, atol=1e-5)  # 16-bit weights
    # Many rows: the fp32 weights (MKL-packed: equal up to the order of the sums).
    torch.testing.assert_close(model(x), exact, rtol=1e-6, atol=1e-6)


def test_sixteen_bit_models_use_prepacked_onednn_where_native():
    model = Tiny().to(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    expected = model(x)
    path = prepare_cpu_linears(model, torch.bfloat16, None)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert path == "F.linear"
        return
    assert path == "oneDNN prepacked"
    for rows in (1, 3, 64):
        torch.testing.assert_close(model(x[:rows]), expected[:rows], rtol=2e-2, atol=2e-2)
    assert matmul(model.a, x[None, :2]).shape == (1, 2, 96)  # leading dims kept


def test_fp32_models_use_mkl_packed_weights_for_any_row_count():
    """The weights are packed once (for 64 rows) and serve every row count in
    PACKED_ROWS, equal to F.linear up to the order of the sums; other row counts
    take F.linear itself."""
    model = Tiny()
    x = torch.randn(300, 64)
    expected = {rows: model(x[:rows]) for rows in (0, 1, 2, 3, 7, 64, 100, 300)}
    path = prepare_cpu_linears(model, torch.float32, None)
    if not torch.backends.mkl.is_available():
        assert path == "F.linear"
        return
    assert path == "MKL prepacked"
    for rows, want in expected.items():
        torch.testing.assert_close(model(x[:rows]), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model(x[:2]), expected[2]) and torch.equal(model(x[:300]), expected[300])
    assert matmul(model.a, x[None, :5]).shape == (1, 5, 96)  # leading dims kept
    # Inside PACKED_ROWS the product reads the packed weight; outside, F.linear.
    assert model.a.cpu_weights.packed.is_mkldnn
    model.a.cpu_weights.packed = torch.ops.mkl._mkl_reorder_linear_weight(
        torch.zeros_like(model.a.weight), 64)
    assert torch.equal(model.a(x[:64]), model.a.bias.expand(64, -1))
    torch.testing.assert_close(model.a(x[:2]), F.linear(x[:2], model.a.weight, model.a.bias))
